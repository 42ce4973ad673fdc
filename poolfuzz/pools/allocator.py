"""Token-slot allocators: page size 1 and paged, with SGLang's free-list order and typed errors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from poolfuzz.pools.errors import DoubleFree, InvalidSlot, MisalignedAlloc, PoolError, PoolExhausted

FreeListener = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True, kw_only=True)
class AllocatorState:
    """A value snapshot of a free list, as ``backup_state`` returns it."""

    free_pages: tuple[int, ...]


class FreeList:
    """A deque of free pages whose never-used tail is kept as a range, not as a million ints.

    It is ``front + [lo, lo+1, ..., hi] + back``: a fresh allocator is just the range, so making
    one (and every ``clear``) costs O(1) whatever the pool size. It supports the deque operations
    the allocators (and fault subclasses) use: ``popleft``, ``append``, ``appendleft``, ``extend``,
    ``extendleft``, ``len`` and iteration, in exactly ``collections.deque`` order.
    """

    __slots__ = ("front", "lo", "hi", "back")

    def __init__(self, pages=(), *, lo: int = 1, hi: int = 0):
        self.front: deque[int] = deque()
        self.lo, self.hi = lo, hi  # the range lo..hi (inclusive); empty when lo > hi
        self.back: deque[int] = deque(pages)

    def __len__(self) -> int:
        return len(self.front) + max(0, self.hi - self.lo + 1) + len(self.back)

    def __iter__(self):
        yield from self.front
        yield from range(self.lo, self.hi + 1)
        yield from self.back

    def popleft(self) -> int:
        if self.front:
            return self.front.popleft()
        if self.lo <= self.hi:
            self.lo += 1
            return self.lo - 1
        return self.back.popleft()

    def take(self, n: int) -> list[int]:
        """``n`` pops from the left at once (the caller checked ``n <= len(self)``)."""
        out = [self.front.popleft() for _ in range(min(n, len(self.front)))]
        if len(out) < n and self.lo <= self.hi:
            k = min(n - len(out), self.hi - self.lo + 1)
            out.extend(range(self.lo, self.lo + k))
            self.lo += k
        out.extend(self.back.popleft() for _ in range(n - len(out)))
        return out

    def append(self, page: int) -> None:
        self.back.append(page)

    def extend(self, pages) -> None:
        self.back.extend(pages)

    def appendleft(self, page: int) -> None:
        self.front.appendleft(page)

    def extendleft(self, pages) -> None:
        self.front.extendleft(pages)

    def explicit(self) -> list[int]:
        """The pages held as ints (freed or given back), in list order, without the range."""
        return [*self.front, *self.back]

    def problem(self, *, reserved: int | None = 0) -> str | None:
        """What is wrong with the list, in O(pages freed so far) not O(pool): a page listed twice
        (a double free that went unseen), or the reserved page listed."""
        seen = set()
        for p in self.explicit():
            if p in seen or self.lo <= p <= self.hi:
                return f"free list holds duplicates: page {p} twice (a double free went unseen)"
            seen.add(p)
        if reserved is not None and (reserved in seen or self.lo <= reserved <= self.hi):
            return f"free list holds the reserved slot/page {reserved}"
        return None


def as_index(indices) -> torch.Tensor:
    """Slot indices as a flat int64 CPU tensor, from a tensor on any device or any iterable of ints."""
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
        self._group: list[torch.Tensor] | None = None  # frees held until free_group_end
        self._free = FreeList(lo=1, hi=self.num_pages)  # O(1): the pages are a range until used
        self._is_free = bytearray(b"\x01") * (self.num_pages + 1)
        self._is_free[0] = 0

    # --- queries -------------------------------------------------------------------------
    def sub_allocators(self) -> dict[str, "TokenAllocator"]:
        return {self.space: self}

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def free_pages(self) -> list[int]:
        return list(self._free)

    def free_list_problem(self) -> str | None:
        """Duplicates or the reserved page 0 in the free list; cost bounded by the frees done."""
        return self._free.problem(reserved=0)

    def is_free_page(self, page: int) -> bool:
        return bool(self._is_free[page])

    def pages_needed(self, *, prefix_len: int, seq_len: int) -> int:
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    # --- allocation ----------------------------------------------------------------------
    def require_pages(self, n: int) -> None:
        """PoolExhausted unless ``n`` pages are free; takes nothing."""
        if n > len(self._free):
            raise PoolExhausted(space=self.space, requested=n * self.page_size,
                                available=self.available_size())

    def alloc_pages(self, n: int) -> list[int]:
        self.require_pages(n)
        pages = self._free.take(n)
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
        needed = self.pages_needed(prefix_len=prefix_len, seq_len=seq_len)
        self.require_pages(needed)  # exhaustion is reported before a misaligned last_loc
        room = 0
        if prefix_len % ps:
            if last_loc <= 0 or (last_loc + 1) % ps != prefix_len % ps:
                raise MisalignedAlloc(
                    f"{self.space}: last_loc {last_loc} is not the slot of position {prefix_len - 1}"
                )
            room = min(ps - prefix_len % ps, n)
        tail = self._tokens_of(self.alloc_pages(needed))[: n - room]
        if not room:  # page size 1, or a prefix ending on a page boundary: nothing to join
            return tail
        head = torch.arange(last_loc + 1, last_loc + 1 + room, dtype=torch.int64)
        return torch.cat([head, tail]) if tail.numel() else head

    def _tokens_of(self, pages: list[int]) -> torch.Tensor:
        ps = self.page_size
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        if ps == 1:  # a page is its slot: one op instead of four
            return torch.tensor(pages, dtype=torch.int64)
        base = torch.as_tensor(pages, dtype=torch.int64) * ps
        return (base[:, None] + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    # --- free ----------------------------------------------------------------------------
    def free(self, indices) -> None:
        idx = as_index(indices)
        if idx.numel() == 0:
            return
        if self._group is not None:  # inside a free group: released, pages deduplicated, at its end
            self._group.append(idx.clone())
            return
        ps = self.page_size
        pages = sorted({t // ps for t in idx.tolist()})
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

    # --- free groups: SGLang's scheduler brackets a batch's frees with these ---------------
    def free_group_begin(self) -> None:
        if self._group is not None:
            raise PoolError(f"{self.space}: free groups cannot be nested")
        self._group = []

    def free_group_end(self) -> None:
        pending, self._group = self._group, None
        if pending:
            self.free(torch.cat(pending))

    # --- snapshots -----------------------------------------------------------------------
    def backup_state(self) -> AllocatorState:
        return AllocatorState(free_pages=tuple(self._free))

    def restore_state(self, state: AllocatorState) -> None:
        self._free = FreeList(state.free_pages)
        self._is_free = bytearray(self.num_pages + 1)
        for p in state.free_pages:
            self._is_free[p] = 1


class SlotAllocator(TokenAllocator):
    """Page-size-1 free list for request rows and mamba slots; slot 0 is reserved."""

    def __init__(self, *, size: int, space: str):
        super().__init__(size=size, page_size=1, space=space)

    def alloc_one(self) -> int:
        return self.alloc_pages(1)[0]
