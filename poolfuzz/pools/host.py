"""Host (CPU) KV pools for host_pool retraction backup; ``slot_used`` catches double alloc and free."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import FreeList, FreeListener, as_index
from poolfuzz.pools.components import Component, zeros
from poolfuzz.pools.errors import DoubleAlloc, DoubleFree, InvalidSlot, MisalignedAlloc, PoolExhausted
from poolfuzz.pools.kv import MHATokenToKVPool


class HostKVPool:
    """Mirror of one device MHA pool on the host: ``k``/``v`` of ``[layers, size, heads, head_dim]``.

    Host slot 0 is *not* reserved (the free list is ``0..size-1``); allocation is in whole pages.
    Pinned memory when the device pool lives off the CPU, so copies can be asynchronous.
    """

    def __init__(self, *, device_pool: MHATokenToKVPool, size: int, page_size: int, space: str):
        if size % page_size:
            raise MisalignedAlloc(f"{space}: host size {size} is not a multiple of page size {page_size}")
        self.size = size
        self.page_size = page_size
        self.space = space
        self.layer_ids = device_pool.layer_ids
        pin = device_pool.device.type != "cpu"
        shape = (len(device_pool.layer_ids), size, *device_pool.k_buffer[0].shape[1:])
        if pin:  # page-locked for asynchronous copies: allocated (and cleared) up front
            self.k = torch.zeros(shape, dtype=device_pool.store_dtype, pin_memory=True)
            self.v = torch.zeros(shape, dtype=device_pool.store_dtype, pin_memory=True)
        else:  # untouched zero pages until a backup writes them, like the device pools on the CPU
            self.k = zeros(shape, dtype=device_pool.store_dtype)
            self.v = zeros(shape, dtype=device_pool.store_dtype)
        self.slot_used = zeros((size,), dtype=torch.bool)
        self.on_free: FreeListener | None = None
        self._free = FreeList(lo=0, hi=size - 1)  # O(1) to build, however large the pool

    def available_size(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def is_free_page(self, unit: int) -> bool:
        return not bool(self.slot_used[unit])

    def free_pages(self) -> list[int]:
        """The free list in its units (host slots), as every allocator answers it."""
        return list(self._free)

    def free_list_problem(self) -> str | None:
        """A slot listed twice; host slot 0 is an ordinary slot, so none is reserved."""
        return self._free.problem(reserved=None)

    def alloc(self, n: int) -> torch.Tensor:
        if n % self.page_size:
            raise MisalignedAlloc(f"{self.space}: alloc({n}) is not a multiple of page size {self.page_size}")
        if n > len(self._free):
            raise PoolExhausted(space=self.space, requested=n, available=len(self._free))
        slots = torch.as_tensor(self._free.take(n), dtype=torch.int64)
        if bool(self.slot_used[slots].any()):
            raise DoubleAlloc(space=self.space, slot=int(slots[self.slot_used[slots]][0]))
        self.slot_used[slots] = True
        return slots

    def free(self, indices) -> None:
        idx = as_index(indices)
        if idx.numel() == 0:
            return
        outside = (idx < 0) | (idx >= self.size)
        if bool(outside.any()):
            raise InvalidSlot(space=self.space, slot=int(idx[outside][0]), reason="out of range")
        if not bool(self.slot_used[idx].all()) or torch.unique(idx).numel() != idx.numel():
            bad = idx[~self.slot_used[idx]]
            raise DoubleFree(space=self.space, slot=int(bad[0]) if bad.numel() else int(idx[0]))
        self.slot_used[idx] = False
        self._free.extend(idx.tolist())
        if self.on_free is not None:
            self.on_free(self.space, idx)

    def backup_from_device(self, device_pool: MHATokenToKVPool, host_idx, dev_idx) -> None:
        h, d = as_index(host_idx), as_index(dev_idx).to(device_pool.device)
        for local in range(len(self.layer_ids)):
            self.k[local, h] = device_pool.k_buffer[local][d].to("cpu")
            self.v[local, h] = device_pool.v_buffer[local][d].to("cpu")

    def load_to_device(self, device_pool: MHATokenToKVPool, host_idx, dev_idx) -> None:
        h, d = as_index(host_idx), as_index(dev_idx).to(device_pool.device)
        for local in range(len(self.layer_ids)):
            device_pool.k_buffer[local][d] = self.k[local, h].to(device_pool.device)
            device_pool.v_buffer[local][d] = self.v[local, h].to(device_pool.device)

    def components(self) -> list[Component]:
        out = []
        for local, layer_id in enumerate(self.layer_ids):
            out.append(Component(name=f"{self.space}.k", layer=layer_id, space=self.space, tensor=self.k[local]))
            out.append(Component(name=f"{self.space}.v", layer=layer_id, space=self.space, tensor=self.v[local]))
        return out
