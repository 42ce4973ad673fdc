"""The forward's KV writes through SGLang's own write door: ``set_kv_buffer`` / ``set_mla_kv_buffer``.

An attention backend does not write the pool's buffers itself: once per layer it hands the layer's K
and V (or MLA's compressed and rope parts) and the batch's ``out_cache_loc`` to the KV pool, and the
pool decides where they land: ``HybridLinearKVPool`` maps the model layer to its full-attention
sub-pool's layer, ``SWAKVPool`` sends a sliding-window layer's rows to the SWA slots the backend
translated the full slots to (``translate_loc_from_full_to_swa``; releases before ``KVWriteLoc``
translate inside), fp8 pools store the bytes as their store dtype. The harness's traceable rows go
through that door, so a pool that files a row under the wrong layer, sub-pool or slot is caught by the
checksums. Components the door does not cover here (DSA's index cache, MXFP8 scales) are written
directly by the harness.
"""

from __future__ import annotations

import inspect

import torch

from poolfuzz.adapters.sglang.api import first_importable


class RadixAttentionFields:
    """The fields of ``RadixAttention`` a pool's write door reads."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id
        self.is_cross_attention = False


def as_pool_dtype(rows: torch.Tensor, pool) -> torch.Tensor:
    """Rows as the dtype the pool takes: fp8 rows are kept as their bytes (``store_dtype``), and the door
    views bytes handed in the pool's own dtype back as the store dtype, unchanged."""
    dtype = getattr(pool, "dtype", rows.dtype)
    return rows.view(dtype) if rows.dtype != dtype and rows.element_size() == torch.empty(0, dtype=dtype).element_size() else rows


def kv_write_loc(pool, loc: torch.Tensor) -> tuple[object, dict]:
    """What the backend passes, as (loc argument, keyword arguments): a ``KVWriteLoc`` with the SWA
    translation where this release has one; before it, a bare loc, with the translation as ``swa_loc=``
    where ``set_kv_buffer`` takes one (0.5.13: the SWA pool never translates itself), else nothing."""
    translate = getattr(pool, "translate_loc_from_full_to_swa", None)
    swa_loc = translate(loc) if translate is not None else None
    write_loc = first_importable("sglang.srt.mem_cache.memory_pool:KVWriteLoc", required=False)
    if write_loc is not None:
        return write_loc(loc, swa_loc=swa_loc), {}
    takes_swa_loc = "swa_loc" in inspect.signature(pool.set_kv_buffer).parameters
    return loc, ({"swa_loc": swa_loc} if takes_swa_loc and swa_loc is not None else {})


def latent_row(rows: dict, layer_id: int, pool) -> torch.Tensor:
    """An MLA layer's rows as the CPU backends hand them to ``set_kv_buffer``: one latent row per token, the
    compressed part then the rope part (a NoPE model's rows keep none), in the pool's dtype."""
    latent = torch.cat([rows[key] for key in latent_keys(rows, layer_id)], dim=-1).unsqueeze(1)
    return as_pool_dtype(latent, pool)


def latent_keys(rows: dict, layer_id: int) -> tuple:
    """The keys of ``rows`` an MLA layer's latent row is written from, in the row's order (no rope part on a NoPE
    model)."""
    return tuple((name, layer_id) for name in ("mla.latent", "mla.rope") if (name, layer_id) in rows)


def write_rows(pool, *, mha_layers, mla_layers, slots: torch.Tensor, rows: dict, model_dtype=None) -> set:
    """Write ``rows[(component, layer)]`` for the full slots ``slots`` through the pool's door, layer by
    layer; return the keys written. ``mha_layers``: (space, layer id) of every K/V layer. ``model_dtype``:
    a pool built with a KV quant method quantises what it is handed, so its rows (the bytes it stores) go
    in as the model computes K and V, in this dtype (exact for every stored byte)."""
    if not rows:
        return set()
    if model_dtype is not None:
        rows = {key: r.view(pool.dtype).to(model_dtype) for key, r in rows.items()}
    device = next(iter(rows.values())).device
    loc = slots.to(device=device, dtype=torch.int64)
    loc_info, loc_kwargs = kv_write_loc(pool, loc)
    done = set()
    for space, layer_id in mha_layers:
        k, v = (f"{space}.k", layer_id), (f"{space}.v", layer_id)
        if k in rows and v in rows:
            k_rows, v_rows = as_pool_dtype(rows[k], pool), as_pool_dtype(rows[v], pool)
            pool.set_kv_buffer(RadixAttentionFields(layer_id), loc_info, k_rows, v_rows, **loc_kwargs)
            done |= {k, v}
    for layer_id in mla_layers:
        if ("mla.latent", layer_id) in rows:
            # The CPU backends' door: one latent row, the compressed part then the rope part (the split
            # ``set_mla_kv_buffer`` is a Triton kernel); ``cache_v`` is not read by an MLA pool.
            pool.set_kv_buffer(RadixAttentionFields(layer_id), loc_info, latent_row(rows, layer_id, pool), None,
                               **loc_kwargs)
            done.update(latent_keys(rows, layer_id))
    return done
