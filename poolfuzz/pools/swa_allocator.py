"""SWA allocator: full and sliding-window sub-allocators joined by the full→SWA mapping."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import AllocatorState, TokenAllocator, as_index
from poolfuzz.pools.components import zeros
from poolfuzz.pools.errors import MisalignedAlloc


class SWATokenAllocator:
    """Allocates every token on the full side and, while it is in the window, on the SWA side.

    ``full_to_swa[t]`` is the SWA slot of full slot ``t``; 0 means unmapped (evicted out of the
    window, or never allocated by tail-only allocation) and the trailing entry is -1, so that a
    ``last_loc`` of -1 translates to -1. Full slot ``t`` and its SWA slot share the offset within
    their pages. ``free_swa`` zeroes the mapping, which is what stops a second free of SWA slots
    that window eviction already released.
    """

    def __init__(self, *, size: int, size_swa: int, page_size: int):
        self.page_size = page_size
        self.full = TokenAllocator(size=size, page_size=page_size, space="full")
        self.swa = TokenAllocator(size=size_swa, page_size=page_size, space="swa")
        self.full_to_swa = zeros((size + page_size + 1,), dtype=torch.int64)  # lazily zeroed pages
        self.full_to_swa[-1] = -1

    @property
    def size(self) -> int:
        return min(self.full.size, self.swa.size)

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa[:-1] = 0

    def sub_allocators(self) -> dict[str, TokenAllocator]:
        return {"full": self.full, "swa": self.swa}

    def available_size(self) -> int:
        return min(self.full.available_size(), self.swa.available_size())

    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def translate(self, indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa[as_index(indices)]

    # --- allocation ----------------------------------------------------------------------
    def _check(self, *, full_pages: int, swa_pages: int) -> None:
        self.full.require_pages(full_pages)
        self.swa.require_pages(swa_pages)

    def alloc(self, n: int) -> torch.Tensor:
        ps = self.page_size
        self._check(full_pages=-(-n // ps), swa_pages=-(-n // ps))
        full = self.full.alloc(n)
        self.full_to_swa[full] = self.swa.alloc(n)
        return full

    def alloc_extend(self, *, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor:
        pages = self.full.pages_needed(prefix_len=prefix_len, seq_len=seq_len)
        self._check(full_pages=pages, swa_pages=pages)
        swa_last = int(self.full_to_swa[last_loc]) if last_loc > 0 else -1
        if prefix_len % self.page_size and swa_last <= 0:
            raise MisalignedAlloc(f"swa: position {prefix_len - 1} (full slot {last_loc}) has no SWA slot "
                                  "to continue its page from")
        full = self.full.alloc_extend(prefix_len=prefix_len, seq_len=seq_len, last_loc=last_loc)
        swa = self.swa.alloc_extend(prefix_len=prefix_len, seq_len=seq_len, last_loc=swa_last)
        self.full_to_swa[full] = swa
        return full

    def alloc_extend_swa_tail(self, *, seq_len: int, swa_tail_len: int) -> torch.Tensor:
        """Full slots for ``[0, seq_len)``, SWA slots for the last ``swa_tail_len`` positions only.

        Used for a resumed or transferred request. The tail starts on a page boundary, so full
        and SWA slots share their page offsets; non-tail positions are mapped to 0 explicitly.
        """
        ps = self.page_size
        head = seq_len - swa_tail_len
        assert head % ps == 0, "the SWA tail must start on a page boundary"
        full_pages = -(-seq_len // ps)
        swa_pages = -(-swa_tail_len // ps)
        self._check(full_pages=full_pages, swa_pages=swa_pages)
        full = self.full.alloc_extend(prefix_len=0, seq_len=seq_len, last_loc=-1)
        swa = self.swa.alloc_extend(prefix_len=0, seq_len=swa_tail_len, last_loc=-1)
        self.full_to_swa[full[:head]] = 0
        self.full_to_swa[full[head:]] = swa
        return full

    # --- free ----------------------------------------------------------------------------
    def free(self, indices) -> None:
        """Free full slots and their SWA peers. Not idempotent: the full side raises DoubleFree."""
        idx = as_index(indices)
        if idx.numel() == 0:
            return
        self.full.free(idx)
        self.free_swa(idx)

    def free_swa(self, indices) -> None:
        """Free the SWA peers of these full slots (whole pages) and zero their mapping."""
        idx = self._widen_to_pages(as_index(indices))
        if idx.numel() == 0:
            return
        swa = self.full_to_swa[idx]
        live = swa[swa > 0]
        self.full_to_swa[idx] = 0
        if live.numel():
            self.swa.free(live)

    def _widen_to_pages(self, idx: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        if ps == 1 or idx.numel() == 0:
            return idx
        pages = torch.unique(idx // ps)
        return (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    # --- free groups: each side piles its frees; free_swa resolves a slot's peer at once ------
    def free_group_begin(self) -> None:
        self.full.free_group_begin()
        self.swa.free_group_begin()

    def free_group_end(self) -> None:
        self.swa.free_group_end()
        self.full.free_group_end()

    # --- snapshots (the mapping is not part of them, as in SGLang) -----------------------
    def backup_state(self) -> tuple[AllocatorState, AllocatorState]:
        return (self.full.backup_state(), self.swa.backup_state())

    def restore_state(self, state: tuple[AllocatorState, AllocatorState]) -> None:
        self.full.restore_state(state[0])
        self.swa.restore_state(state[1])
