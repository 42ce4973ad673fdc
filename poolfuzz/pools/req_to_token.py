"""Request rows: ``req_to_token[row, pos]`` holds the full-KV slot of each position; row 0 is padding."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import SlotAllocator, as_index
from poolfuzz.pools.errors import DoubleFree, InvalidSlot
from poolfuzz.pools.mamba import MambaPool, MambaSlotAllocator


class ReqToTokenPool:
    """``req_to_token`` is int32 ``[rows+1, max_context]``, zero-initialised; rows are reused FIFO.

    ``mamba_pool`` is a capability: None here, the request pool's MambaPool on the hybrid pool.
    Dispatch (the retraction backup, the PD fallback) reads it instead of testing the class.
    """

    mamba_pool: MambaPool | None = None

    def __init__(self, *, size: int, max_context: int, device: torch.device):
        self.size = size
        self.max_context = max_context
        self.device = torch.device(device)
        # Kept on the host: the engine reads rows on every step, and these reads must not sync.
        self.req_to_token = torch.zeros((size + 1, max_context), dtype=torch.int32)
        self.rows = SlotAllocator(size=size, space="rows")

    def available_size(self) -> int:
        return self.rows.available_size()

    def alloc(self) -> int:
        return self.rows.alloc_one()

    def free(self, row: int) -> None:
        self.rows.free([row])

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if row <= 0:
            raise InvalidSlot(space="rows", slot=row, reason="row 0 is the padding row")
        self.req_to_token[row, start:start + slots.numel()] = slots.to(torch.int32)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[row, start:end].to(torch.int64)

    def clear(self) -> None:
        """Rebuild the free list; like SGLang, stale rows in ``req_to_token`` are not zeroed."""
        self.rows.clear()


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows plus the MambaPool, its slot allocator and the row→mamba-slot mirror."""

    def __init__(self, *, size: int, max_context: int, device: torch.device, mamba_pool: MambaPool,
                 mamba_allocator_cls: type = MambaSlotAllocator):
        super().__init__(size=size, max_context=max_context, device=device)
        self.mamba_pool = mamba_pool
        self.mamba_allocator = mamba_allocator_cls(size=mamba_pool.size)
        self.req_to_mamba = torch.zeros(size + 1, dtype=torch.int32)

    def alloc_mamba(self, row: int) -> int:
        """A fresh slot for ``row``. Not zeroed: the caller marks it as needing a clear."""
        slot = self.mamba_allocator.alloc_one()
        self.req_to_mamba[row] = slot
        return slot

    def get_mamba_indices(self, rows) -> torch.Tensor:
        """The mamba slot of each row, as the attention kernels read it (SGLang's ``get_mamba_indices``)."""
        return self.req_to_mamba[as_index(rows)].to(torch.int64)

    def free_mamba(self, row: int, slot: int | None) -> None:
        if slot is None:
            raise DoubleFree(space="mamba", slot=-1)
        self.mamba_allocator.free([slot])
        self.req_to_mamba[row] = 0

    def get_state_buf_infos(self) -> list[torch.Tensor]:
        """The PD fallback: MAMBA state buffers taken from the request pool."""
        return self.mamba_pool.get_state_buf_infos()

    def clear(self) -> None:
        super().clear()
        self.mamba_allocator.clear()
        self.req_to_mamba.zero_()
