"""Catalogue faults of the free patterns SGLang's callers make: grouped frees and aborts mid-prefill.

Each is the smallest override of the correct class; the docstring says what the correct code does.
"""

from __future__ import annotations

from poolfuzz.pools.protocol import ServingProtocol
from poolfuzz.pools.swa_allocator import SWATokenAllocator


class FreeGroupDropsSWAPile(SWATokenAllocator):
    """``free_group_end`` releases the full side's pile but drops the SWA slots that ``free_swa``
    resolved inside the group (SGLang's SWA allocator keeps its own piles, ``swa_free_group`` and
    ``swa_page_ids_group``, beside the full allocator's group; an end that flushes only the full
    side leaks every SWA slot a grouped window eviction or release freed)."""

    def free_group_end(self) -> None:
        self.swa._group = None  # the SWA pile is dropped, not released
        self.full.free_group_end()


class AbortMidPrefillLeaksLastChunk(ServingProtocol):
    """An abort between two prefill chunks frees the row only up to where the last chunk began (the
    prefix an earlier chunk had settled), so the slots the last chunk allocated leak. The correct
    release frees every allocated position, wherever the last chunk ended."""

    def __init__(self):
        self.chunk_start: dict[int, int] = {}  # rid -> where its last extend began

    def extend(self, req, family, new_len):
        self.chunk_start[req.rid] = req.kv_allocated_len
        return super().extend(req, family, new_len)

    def abort(self, req, family):
        if req.req_pool_idx is not None:  # live: only what came before the last chunk is freed
            req.kv_allocated_len = min(req.kv_allocated_len, self.chunk_start.get(req.rid, 0))
        super().abort(req, family)
