"""Token-slot allocators: page size 1 and paged, with SGLang's free-list order and typed errors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from poolfuzz.pools.errors import DoubleFree, InvalidSlot, MisalignedAlloc, PoolExhausted

FreeListener = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True, kw_only=True)
class AllocatorState:
    """A value snapshot of a free list, as ``backup_state`` returns it."""

    free_pages: tuple[int, ...]


def _as_index(indices) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        return indices.to(device="cpu", dtype=torch.int64).reshape(-1)
    return torch.as_tensor(list(indices), dtype=torch.int64)


class TokenAllocator:
    """Hands out KV token slots in whole pages; page 0 (slots ``0..page_size-1``) is padding.

    Invariants:
      1. A page is either in the free list or held by exactly one caller.
      2. ``free`` of any token frees its whole page (SGLang's paged allocator).
      3. Page size 1 appends freed slots at the tail (FIFO reuse); page size > 1 puts freed pages
         at the front, so they are handed out next — both as SGLang does.
      4. Freeing a free page raises ``DoubleFree``; SGLang detects this only in debug mode.
    """

    def __init__(self, *, size: int, page_size: int = 1, space: str = "full"):
        if size % page_size:
            raise MisalignedAlloc(f"{space} size {size} is not a multiple of page size {page_size}")
        self.size = size
        self.page_size = page_size
        self.space = space
        self.num_pages = size // page_size
        self.on_free: FreeListener | None = None  # told the token slots of every freed page
        self.clear()

    def clear(self) -> None:
        self._free: deque[int] = deque(range(1, self.num_pages + 1))
        self._is_free = bytearray(b"\x00" + b"\x01" * self.num_pages)

    # --- queries -------------------------------------------------------------------------
    def sub_allocators(self) -> dict[str, "TokenAllocator"]:
        return {self.space: self}

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def free_pages(self) -> list[int]:
        return list(self._free)

    def is_free_page(self, page: int) -> bool:
        return bool(self._is_free[page])

    def pages_needed(self, *, prefix_len: int, seq_len: int) -> int:
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    # --- allocation ----------------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(space=self.space, requested=n * self.page_size,
                                available=self.available_size())
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` token slots in whole pages; ``n`` must be page-aligned."""
        if n % self.page_size:
            raise MisalignedAlloc(f"{self.space}: alloc({n}) is not a multiple of page size {self.page_size}")
        return self._tokens_of(self.alloc_pages(n // self.page_size))

    def alloc_extend(self, *, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor:
        """Slots for positions ``[prefix_len, seq_len)`` of one request whose slot at
        ``prefix_len - 1`` is ``last_loc``: first the rest of that page, then new pages."""
        ps = self.page_size
        n = seq_len - prefix_len
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        pages = self.alloc_pages(self.pages_needed(prefix_len=prefix_len, seq_len=seq_len))
        head = []
        if prefix_len % ps:
            if last_loc <= 0 or (last_loc + 1) % ps != prefix_len % ps:
                self._give_back(pages)
                raise MisalignedAlloc(
                    f"{self.space}: last_loc {last_loc} is not the slot of position {prefix_len - 1}"
                )
            room = min(ps - prefix_len % ps, n)
            head = list(range(last_loc + 1, last_loc + 1 + room))
        tail = self._tokens_of(pages)[: n - len(head)]
        return torch.cat([torch.as_tensor(head, dtype=torch.int64), tail])

    def _give_back(self, pages: list[int]) -> None:
        for p in reversed(pages):
            self._free.appendleft(p)
            self._is_free[p] = 1

    def _tokens_of(self, pages: list[int]) -> torch.Tensor:
        ps = self.page_size
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        base = torch.as_tensor(pages, dtype=torch.int64) * ps
        return (base[:, None] + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    # --- free ----------------------------------------------------------------------------
    def free(self, indices) -> None:
        idx = _as_index(indices)
        if idx.numel() == 0:
            return
        pages = sorted(set((idx // self.page_size).tolist()))
        for p in pages:
            if p <= 0 or p > self.num_pages:
                raise InvalidSlot(space=self.space, slot=p * self.page_size,
                                  reason="page 0 is padding" if p == 0 else "out of range")
            if self._is_free[p]:
                raise DoubleFree(space=self.space, slot=p * self.page_size)
        self._release(pages)

    def _release(self, pages: list[int]) -> None:
        for p in pages:
            self._is_free[p] = 1
        if self.page_size == 1:
            self._free.extend(pages)
        else:
            self._free.extendleft(reversed(pages))
        if self.on_free is not None:
            self.on_free(self.space, self._tokens_of(pages))

    # --- snapshots -----------------------------------------------------------------------
    def backup_state(self) -> AllocatorState:
        return AllocatorState(free_pages=tuple(self._free))

    def restore_state(self, state: AllocatorState) -> None:
        self._free = deque(state.free_pages)
        self._is_free = bytearray(self.num_pages + 1)
        for p in state.free_pages:
            self._is_free[p] = 1


class SlotAllocator(TokenAllocator):
    """Page-size-1 free list for request rows and mamba slots; slot 0 is reserved."""

    def __init__(self, *, size: int, space: str):
        super().__init__(size=size, page_size=1, space=space)

    def alloc_one(self) -> int:
        return self.alloc_pages(1)[0]
