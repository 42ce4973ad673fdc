"""The attention backend's read door: the KV tensors a layer's kernels get from the pool, which the harness checksums.

A backend never indexes ``k_buffer`` itself: per layer it asks the model's KV pool for
``get_key_buffer(layer_id)`` / ``get_value_buffer(layer_id)`` by model layer id, and the pool routes the
id (``SWAKVPool`` to its full or SWA sub-pool, ``HybridLinearKVPool`` to its full-attention sub-pool's
local layer, fp8 pools viewing their store dtype as the model dtype). The harness's components are those
tensors (viewed back as the bytes the pool stores), so what the checksums compare is what the kernels
read: a pool whose read door routes a layer elsewhere than its write door (``writes.py``) filed the row is
caught as lost contents. A door that hands out a copy instead of its buffer is refused when the family is
built (the harness's frees poison the buffer in place).
"""

from __future__ import annotations

import torch

from poolfuzz.pools.errors import ConfigError


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def pool_buffers(pool) -> list[torch.Tensor]:
    """Every KV buffer of a model's KV pool and of its sub-pools (full, SWA)."""
    out = []
    for p in (pool, getattr(pool, "full_kv_pool", None), getattr(pool, "swa_kv_pool", None)):
        for name in ("k_buffer", "v_buffer", "kv_buffer"):
            out += list(getattr(p, name, None) or [])
    return out


def read_door(pool, getter: str, layer_id: int, raw: torch.Tensor) -> torch.Tensor:
    """``pool.<getter>(layer_id)`` as the pool stores it (``raw``'s dtype); ``raw`` where the pool has no such
    door. The door must hand out one of the pool's KV buffers in place."""
    door = getattr(pool, getter, None)
    if door is None:
        return raw
    got = door(layer_id)
    if got.dtype != raw.dtype and got.element_size() == raw.element_size():
        got = got.view(raw.dtype)
    if _storage(got) not in {_storage(b) for b in pool_buffers(pool)}:
        raise ConfigError(f"{type(pool).__name__}.{getter}({layer_id}) hands out a copy, not a KV buffer of the "
                          "pool; poolfuzz checksums what the kernels read in place")
    return got


def mamba_layer_states(req_pool, layer_ids, conv: list[torch.Tensor], temporal: torch.Tensor
                       ) -> dict[int, tuple[list[torch.Tensor], torch.Tensor]]:
    """Each mamba layer's (conv tensors, temporal) as the linear-attention kernels get them: the request
    pool's ``mamba2_layer_cache(layer_id)`` by model layer id (``HybridReqToTokenPool`` maps the id through
    its ``mamba_map``, the MambaPool slices its ``State`` with ``at_layer_idx``). A pool that sends two layers
    to one state has them overwrite each other, which the checksums catch. ``conv`` / ``temporal`` (every
    layer, ``[layers, slots+1, ...]``) where the release has no such door; a door that hands out a copy is
    refused (the kernels update the state in place)."""
    door = getattr(req_pool, "mamba2_layer_cache", None)
    if door is None:
        return {layer_id: ([c[local] for c in conv], temporal[local]) for local, layer_id in enumerate(layer_ids)}
    owned = {_storage(t) for t in [*conv, temporal]}
    out = {}
    for layer_id in layer_ids:
        state = door(layer_id)
        got_conv, got_temporal = list(state.conv), state.temporal
        if isinstance(state.conv, torch.Tensor):  # a release whose State holds one conv tensor
            got_conv = [state.conv]
        if any(_storage(t) not in owned for t in [*got_conv, got_temporal]):
            raise ConfigError(f"{type(req_pool).__name__}.mamba2_layer_cache({layer_id}) hands out a copy, not the "
                              "MambaPool's state; poolfuzz checksums what the kernels update in place")
        out[layer_id] = (got_conv, got_temporal)
    return out


def stored_bytes(buf: torch.Tensor) -> torch.Tensor:
    """A KV buffer stored as an fp8 dtype itself (a pool built with a KV quant method, and its host pool) as
    the bytes the harness writes and checksums, as SGLang's other fp8 pools store them (uint8)."""
    return buf.view(torch.uint8) if buf.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else buf
