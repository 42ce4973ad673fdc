"""The frees SGLang's callers make, in the shapes they make them: free groups, row segments, and the
mamba slot group of a scheduling pass.

* **Free groups.** The scheduler brackets the frees of a batch with the allocator's
  ``free_group_begin`` / ``free_group_end``: ``ScheduleBatch.maybe_evict_swa`` every window
  eviction pass, ``process_batch_result_prefill`` / ``_decode`` every request they release (a
  finish, an abort, the over-allocated tail of a speculative request). Inside a group the
  allocators only pile the frees up (the SWA allocator resolves a slot's peer at once and releases
  it at the end), so what a group frees reaches the free lists at ``free_group_end``. A retraction
  (``release_req``) frees outside any group.
* **Row segments.** Where the release has ``free_kv_row_segments`` (the tree cache's ``free_kv_row``),
  a request's row goes back as ``release_kv_cache`` gives it: ``[cache_protected_len, owned)`` (the
  chunk cache protects nothing), then the over-allocated tail ``[ceil_align(owned), allocated)``
  (``_release_overallocated_kv_indices``); each split at the SWA eviction frontier into a part whose
  SWA peers are gone (``free_full_segments``) and a live part (``free_segments``).
* **Mamba slot groups.** Each prefill scheduling pass brackets its walk of the waiting queue with
  ``mamba_allocator.alloc_group_begin(len(waiting_queue))`` / ``alloc_group_end()``: slots taken for
  prefix matches the pass did not use go back to the end of the free list.

Releases without one of these calls get the plain call they have (``free``, no group).

The pools are built with SGLang's own debug switch on (``SGLANG_DEBUG_MEMORY_POOL``, read when an
allocator is constructed): the paged allocators then check, after every call, that the pages a
free or an allocation touches are the ones its caller meant and that no page is listed twice. Those
are the engine's own invariants; an assertion they raise is reported as what the pools did.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import accepted_kwargs, switched_on
from poolfuzz.pools.protocol import free_group  # noqa: F401 - the same bracket for SGLang's allocators


DEBUG_SWITCH = "SGLANG_DEBUG_MEMORY_POOL"


def debug_memory_pool():
    """SGLang's memory-pool debug switch on while pools are constructed (each reads it then)."""
    return switched_on(DEBUG_SWITCH)




def row_segments_supported(family) -> bool:
    """Does this release free a row by segments (``free_kv_row_segments`` over ``free_segments``)?"""
    return family.api.free_kv_row_segments is not None and hasattr(family.sg_allocator, "free_segments")


def free_row_segment(family, row: int, start: int, end: int, *, swa_evicted: int) -> None:
    """Free positions ``[start, end)`` of a request row the way the release's tree cache does."""
    if end <= start:
        return
    tokens = family.sg_req_pool.req_to_token[row, start:end].to(torch.int64)
    seg = family.api.free_kv_row_segments
    if row_segments_supported(family):
        seg(family.sg_allocator, [(tokens, start)], **accepted_kwargs(
            seg, swa_evicted_seqlen=swa_evicted, swa_dead_lo=0))
    elif seg is not None and family.config.has_swa and start == 0:
        # releases whose segment free takes the whole row (no start positions of its own)
        seg(family.sg_allocator, [(tokens, 0)], **accepted_kwargs(seg, swa_evicted_seqlen=swa_evicted, swa_dead_lo=0))
    else:
        if window_only(family):  # PureSWAChunkCache.cache_finished_req: the evicted range is already free
            tokens = tokens[max(0, swa_evicted - start):]
        family.sg_allocator.free(tokens)


def window_only(family) -> bool:
    """An all-SWA model's allocator (``PureSWATokenToKVPoolAllocator``: one allocator serves as both sides),
    whose row slots before the SWA frontier were freed by window eviction and have no full peer to keep."""
    alloc = family.sg_allocator
    return getattr(alloc, "full_attn_allocator", None) is not None and alloc.full_attn_allocator is getattr(
        alloc, "swa_attn_allocator", None)


def release_row(family, row: int, *, committed: int, allocated: int, swa_evicted: int) -> None:
    """``release_kv_cache``'s two frees of a chunk-cache request: what it owns, then the over-allocated tail."""
    if not row_segments_supported(family):
        free_row_segment(family, row, 0, allocated, swa_evicted=swa_evicted)
        return
    owned = min(committed, allocated)
    free_row_segment(family, row, 0, owned, swa_evicted=swa_evicted)
    ps = family.config.page_size
    free_row_segment(family, row, -(-owned // ps) * ps, allocated, swa_evicted=swa_evicted)


def scheduling_pass(req_pool, waiting: int = 1) -> None:
    """The mamba slot group of one prefill scheduling pass over ``waiting`` queued requests. The chunk
    cache matches no prefix, so nothing in the group is used: ``alloc_group_end`` gives it all back."""
    allocator = getattr(req_pool, "mamba_allocator", None)
    begin = getattr(allocator, "alloc_group_begin", None)
    if begin is None:
        return
    begin(waiting)
    allocator.alloc_group_end()
