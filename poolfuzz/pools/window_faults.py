"""Catalogue faults planted in an all-SWA model's pools, whose token slots are the sliding window's own."""

from __future__ import annotations

from poolfuzz.pools.protocol import ServingProtocol


class ReleaseFreesEvictedWindow(ServingProtocol):
    """Releases an all-SWA request's whole row, ``[0, kv_allocated_len)``, as a model with full attention
    does (where the full slots are still held and the evicted positions' SWA peers are unmapped): here the
    row's slots before ``swa_evicted_seqlen`` were already freed by window eviction, so the release frees
    them a second time, or, once they were handed to another request, frees that request's KV (SGLang's
    ``release_kv_cache`` frees from ``swa_dead_lo``)."""

    def release_start(self, req, family) -> int:
        return 0
