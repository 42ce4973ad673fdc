"""Faults of a cache flush: a pool whose in-place reset forgets part of what it holds."""

from __future__ import annotations

from poolfuzz.pools.req_to_token import HybridReqToTokenPool


class ClearKeepsStateSlots(HybridReqToTokenPool):
    """``clear`` rebuilds the request rows and the row-to-mamba mapping but leaves the mamba slot
    allocator as it was. A flush drops the prefix tree without freeing its checkpoints one by one, so
    every slot the tree held stays taken by nobody: a leak that grows with each flush (as SGLang's int8
    checkpoint pool leaked its radix-cached states before ``HybridReqToTokenPool.clear`` cleared it too).
    The correct pool resets every allocator it owns."""

    def clear(self) -> None:
        self.rows.clear()
        self.req_to_mamba.zero_()
