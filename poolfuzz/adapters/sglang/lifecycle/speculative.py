"""Speculative decoding's recurrent scratch on SGLang's real MambaPool, and the commit after verify.

With ``speculative_num_draft_tokens`` SGLang's ``MambaPool`` allocates its intermediate caches
(``intermediate_ssm`` and ``intermediate_conv_window``, ``[layers, spec_state_size + 1, draft_tokens,
*state]``) and hands them to the attention backend through ``get_speculative_mamba2_params_all_layers``.
The harness's verify forward writes the request's scratch row of them (the request row: SGLang's
stable-rows layout), and the commit is the scatter ``update_mamba_state_after_mtp_verify`` runs: on a
GPU a fused Triton kernel, on other devices ``dst[:, dst_rows] = src[:, src_rows, step]``
(``HybridLinearAttnBackend._scatter_speculative_state_with_mask``). The backend module does not
import without the server's dependencies, so the adapter runs that same scatter on the buffers SGLang's
accessor returns.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import parameters
from poolfuzz.adapters.sglang.compat import conv_window_buffers
from poolfuzz.adapters.sglang.pools.calls import native_kv_move
from poolfuzz.adapters.sglang.pools.request_pool import build_request_pool
from poolfuzz.adapters.sglang.pools.storage import what_failed
from poolfuzz.pools.speculative import scratch_components


def speculative_problem(api, config) -> str | None:
    """Why this release cannot build the config's speculative scratch, or None."""
    if not config.spec_draft_tokens:
        return None
    if ("speculative_num_draft_tokens" not in parameters(api.HybridReqToTokenPool)
            or not hasattr(api.MambaPool, "get_speculative_mamba2_params_all_layers")):
        return f"SGLang {api.version}'s MambaPool keeps no speculative intermediate state caches"
    return _probe(api, config)


_PROBED: dict = {}


def _probe(api, config) -> str | None:
    """Build the config's request pool once, with its speculative caches: what a release cannot build on
    this device (some assert CUDA for them) is declined with SGLang's own message."""
    key = (config.mamba_layers, config.conv_shapes, config.temporal_shape, config.state_dtype,
           config.spec_draft_tokens)
    if key not in _PROBED:
        try:
            pool = build_request_pool(api, config, "cpu")
            SGLangScratch(pool, layer_ids=config.mamba_layer_ids, draft_tokens=config.spec_draft_tokens)
            _PROBED[key] = None
        except Exception as exc:  # noqa: BLE001 - any refusal of the constructors declines the config
            first = str(exc).splitlines()[0] if str(exc) else ""
            _PROBED[key] = (f"SGLang {api.version} cannot build the speculative caches on this device "
                            f"({type(exc).__name__}: {first})")
    return _PROBED[key]


class SGLangScratch:
    """The intermediate caches of SGLang's MambaPool as the harness's scratch components."""

    def __init__(self, req_pool, *, layer_ids, draft_tokens: int):
        self.req_pool = req_pool
        self.layer_ids = layer_ids
        self.draft_tokens = draft_tokens
        caches = req_pool.get_speculative_mamba2_params_all_layers()
        windows = list(caches.intermediate_conv_window)
        phys = conv_window_buffers(req_pool.mamba_pool, windows)
        if any(w.data_ptr() != p.data_ptr() or w.shape != p.shape for w, p in zip(windows, phys)):
            # CUDA with a chain of drafts: consecutive steps' conv windows share columns by design, so a
            # step's row is not its own and cannot carry its own tag.
            raise ValueError("the deduplicated conv-window layout shares columns between draft steps; the "
                             "harness needs the dense layout (a CPU pool, or speculative_eagle_topk > 1)")
        if caches.intermediate_ssm is None:
            raise ValueError("the pool keeps no intermediate_ssm (ReplaySSM spec verify)")
        self.buffers = windows + [caches.intermediate_ssm]
        self.state_names = [(f"mamba.conv{i}", None) for i in range(len(windows))] + [("mamba.temporal", None)]

    def components(self):
        return scratch_components(self.state_names, self.buffers, self.layer_ids, self.draft_tokens)


def commit(req_pool, *, row: int, accepted_step: int, state_slot: int, track_slot: int | None) -> None:
    """``update_mamba_state_after_mtp_verify`` for one request: the accepted step's conv windows and
    temporal state, read through SGLang's accessor, into the state slot (and the track slot)."""
    caches = req_pool.get_speculative_mamba2_params_all_layers()
    slots = [state_slot] if track_slot is None else [state_slot, track_slot]
    pairs = list(zip(caches.conv, caches.intermediate_conv_window)) + [(caches.temporal, caches.intermediate_ssm)]
    for dst, src in pairs:
        for slot in slots:
            dst[:, slot] = src[:, row, accepted_step]


def move_accepted(family, *, tgt, src) -> None:
    """A tree verify's accepted path to the front of the window, as ``move_accept_tokens_to_target_kvcache``
    ends: ``token_to_kv_pool_allocator.get_kvcache().move_kv_cache(tgt_cache_loc, accept_out_cache_loc)``
    (the model's KV pool moves every layer, and an SWA pool its SWA peers through ``full_to_swa``)."""
    alloc = family.sg_allocator
    kv_pool = alloc.get_kvcache() if hasattr(alloc, "get_kvcache") else family.sg_kv_pool
    device = family.device
    with native_kv_move():  # releases up to 0.5.22 read the switch at each move, 0.5.23 when the pool is built
        kv_pool.move_kv_cache(tgt.to(device=device, dtype=torch.int64), src.to(device=device, dtype=torch.int64))


def move_problem(sg_kv, device) -> str | None:
    """Why the built KV pool cannot move a row here (the padding slot onto itself, which changes nothing), or
    None. The move is SGLang's native one (the Triton row copy needs a GPU), so what it raises is said: a
    kernel this machine cannot launch, or a defect of the native path itself (0.5.21-0.5.23's MXFP8 pool has
    no ``native_k_scale_buffer`` for the native move to read: an AttributeError under
    ``SGLANG_NATIVE_MOVE_KV_CACHE=1`` on a GPU too)."""
    move = getattr(sg_kv, "move_kv_cache", None)
    if move is None:
        return f"{type(sg_kv).__name__} has no move_kv_cache"
    pad = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        with native_kv_move():
            move(pad, pad)
    except Exception as exc:  # what a missing kernel or a broken native path raises varies by release
        return f"{type(sg_kv).__name__}.move_kv_cache (native) raises {type(exc).__name__}: {what_failed(exc)}"
    return None
