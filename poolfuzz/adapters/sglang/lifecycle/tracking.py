"""Mamba extra-buffer mode on SGLang's real pools: the ping-pong track slots and the scheduler's turn-taking.

SGLang's own ``HybridReqToTokenPool`` (built with ``enable_mamba_extra_buffer=True``) allocates a
request's track slots in ``alloc`` (``_alloc_ping_pong_buffer``), maps them per row
(``req_index_to_mamba_ping_pong_track_buffer_mapping``, what the attention backend reads the
track indices from) and frees them in ``free_mamba_cache``. Which slot a forward writes is the
scheduler's bookkeeping on the request: ``mamba_next_track_idx`` names it, and after a forward
that tracked its state the result processor moves ``mamba_last_track_idx`` to it and
``mamba_next_track_idx`` to ``get_mamba_ping_pong_other_idx`` (the other one with the overlap
schedule). The adapter runs that bookkeeping as the result processor does, with every forward at
a track boundary (the built-in family's rule: each forward leaves its state in the next track slot).
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import parameters
from poolfuzz.adapters.sglang.pools.views import as_ints
from poolfuzz.pools.request import ReqKv


def extra_buffer_problem(api, config) -> str | None:
    """Why this release cannot build the config's extra-buffer mode, or None (probes, never versions)."""
    if not config.mamba_track_slots:
        return None
    params = parameters(api.HybridReqToTokenPool)
    missing = [k for k in ("enable_mamba_extra_buffer", "enable_overlap_schedule") if k not in params]
    if missing or not hasattr(api.HybridReqToTokenPool, "get_mamba_ping_pong_other_idx"):
        return (f"SGLang {api.version}'s HybridReqToTokenPool has no ping-pong extra-buffer mode "
                f"({', '.join(missing) or 'get_mamba_ping_pong_other_idx'} missing)")
    return None


def extra_buffer_admission_problem(api, config) -> str | None:
    """Why the adapter's own admission cannot drive the config's extra-buffer mode on this release, or None (the
    scheduler path drives the release's admission itself and never asks)."""
    if config.mamba_track_slots and api.ensure_mamba_capacity is None:
        # These releases' admission (alloc_req_slots) counts one mamba slot a request unless a mamba
        # radix cache is on, and the mode only runs with that cache there: without it, admission
        # undercounts by design and alloc asserts. The adapter drives the chunk cache only.
        return (f"SGLang {api.version} admits extra-buffer requests through its mamba radix cache's headroom "
                "(no ensure_mamba_capacity), which the adapter does not drive")
    return None


def _record(sg):
    """Where this release keeps the request's mamba fields (``req.kv`` from 0.5.19, else the request)."""
    kv = getattr(sg, "kv", None)
    return kv if kv is not None and hasattr(kv, "mamba_ping_pong_track_buffer") else sg


def mirror(req: ReqKv, sg) -> None:
    """Copy the track slots SGLang's ``alloc`` gave the request into the harness's record."""
    buf = getattr(_record(sg), "mamba_ping_pong_track_buffer", None)
    req.mamba_track = () if buf is None else tuple(s for s in as_ints(buf) if s >= 0)
    req.track_writes = 0


def next_slot(req: ReqKv, sg, pool) -> int | None:
    """The track slot this forward writes (``mamba_next_track_idx``), then the result processor's
    turn: the written index becomes the last tracked one and the next is the other."""
    kv = _record(sg)
    buf = getattr(kv, "mamba_ping_pong_track_buffer", None)
    if buf is None or kv.mamba_next_track_idx is None:
        return None
    idx = kv.mamba_next_track_idx
    slot = int(buf[idx])
    kv.mamba_last_track_idx = idx
    kv.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(idx)
    req.track_writes += 1
    return slot

