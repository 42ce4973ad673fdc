"""All-SWA models (every layer sliding-window): one allocator whose slots are the window's, SGLang's Pure-SWA."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import AllocatorState, TokenAllocator, as_index
from poolfuzz.pools.errors import MisalignedAlloc
from poolfuzz.pools.kv import SWAKVPool


class PureSWATokenAllocator:
    """One allocator of SWA slots (SGLang's ``PureSWATokenToKVPoolAllocator``): ``req_to_token`` holds the SWA
    slots themselves, ``translate`` is the identity, and ``free_swa`` frees the slots a window eviction lets go.

    ``window_only``: True. A position the window evicted has no slot any more (its row keeps the stale
    value), so whoever releases a request frees only ``[swa_evicted_seqlen, kv_allocated_len)``: freeing
    from 0 would free the evicted slots a second time, or somebody else's once they were reused.
    """

    window_only = True

    def __init__(self, *, size_swa: int, page_size: int):
        if page_size != 1:
            raise MisalignedAlloc(f"an all-SWA allocator allocates single slots (page size 1), got {page_size}")
        self.page_size = page_size
        self.swa = TokenAllocator(size=size_swa, page_size=1, space="swa")
        # What the KV pool reads as full_to_swa: the identity over every slot, then the -1 of last_loc = -1
        self.full_to_swa = torch.cat([torch.arange(size_swa + 1, dtype=torch.int64), torch.tensor([-1])])

    @property
    def size(self) -> int:
        return self.swa.size

    def clear(self) -> None:
        self.swa.clear()

    def sub_allocators(self) -> dict[str, TokenAllocator]:
        return {"swa": self.swa}

    def available_size(self) -> int:
        return self.swa.available_size()

    full_available_size = swa_available_size = available_size

    def translate(self, indices) -> torch.Tensor:
        return as_index(indices)

    def alloc(self, n: int) -> torch.Tensor:
        return self.swa.alloc(n)

    def alloc_extend(self, *, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor:
        return self.swa.alloc_extend(prefix_len=prefix_len, seq_len=seq_len, last_loc=last_loc)

    def free(self, indices) -> None:
        """Free the slots (the one pool's): a release, or the rejected tail of a speculative step."""
        idx = as_index(indices)
        if idx.numel():
            self.swa.free(idx[idx > 0])

    def free_swa(self, indices) -> None:
        """Window eviction: the slots of positions that slid out of the window go back."""
        self.free(indices)

    def free_group_begin(self) -> None:
        self.swa.free_group_begin()

    def free_group_end(self) -> None:
        self.swa.free_group_end()

    def backup_state(self) -> AllocatorState:
        return self.swa.backup_state()

    def restore_state(self, state: AllocatorState) -> None:
        self.swa.restore_state(state)


class PureSWAKVPool(SWAKVPool):
    """An all-SWA model's KV pool: SGLang's ``SWAKVPool`` with no full layers, addressed by the identity.

    ``supports_host_pool_backup``: False; SGLang's host-pool retraction goes through the unified tree,
    which rejects all-SWA models, so they back up to CPU tensors."""

    supports_host_pool_backup = False
