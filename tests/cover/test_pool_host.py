"""Host KV pool: slot 0 usable, page-aligned allocation, slot_used double-alloc/double-free detection."""

import pytest
import torch

from poolfuzz.pools.errors import DoubleFree, InvalidSlot, MisalignedAlloc, PoolExhausted
from poolfuzz.pools.host import HostKVPool
from poolfuzz.pools.kv import MHATokenToKVPool


def ids(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


def device_pool(page_size=4, dtype="bfloat16") -> MHATokenToKVPool:
    return MHATokenToKVPool(size=16, page_size=page_size, dtype=dtype, head_num=2, head_dim=8,
                            layer_ids=(0, 1), device="cpu")


def host(page_size=4, size=8, dtype="bfloat16") -> tuple[HostKVPool, MHATokenToKVPool]:
    dev = device_pool(page_size, dtype)
    return HostKVPool(device_pool=dev, size=size, page_size=page_size, space="host.full"), dev


class TestHostKVPool:
    def test_layout_mirrors_the_device_pool(self):
        """k and v are [layers, size, heads, head_dim] in the device store dtype, unpinned for a CPU device."""
        pool, _ = host(dtype="fp8_e4m3")
        assert tuple(pool.k.shape) == (2, 8, 2, 8)
        assert pool.k.dtype == pool.v.dtype == torch.uint8
        assert not pool.k.is_pinned()
        assert [(c.name, c.layer, c.space) for c in pool.components()] == [
            ("host.full.k", 0, "host.full"), ("host.full.v", 0, "host.full"),
            ("host.full.k", 1, "host.full"), ("host.full.v", 1, "host.full"),
        ]

    def test_slot_zero_is_usable(self):
        """Host slot 0 is not reserved: the first allocation is slots 0..page_size-1."""
        pool, _ = host()
        assert pool.free_slots() == list(range(8))
        assert ids(pool.alloc(4)) == [0, 1, 2, 3]
        assert pool.available_size() == 4

    def test_misaligned_alloc_raises(self):
        """alloc of a count that is not a whole number of pages raises MisalignedAlloc."""
        pool, _ = host()
        with pytest.raises(MisalignedAlloc):
            pool.alloc(3)
        assert pool.available_size() == 8

    def test_misaligned_size_is_rejected(self):
        """A host pool whose size is not a whole number of pages cannot be built."""
        with pytest.raises(MisalignedAlloc):
            HostKVPool(device_pool=device_pool(), size=6, page_size=4, space="host.full")

    def test_exhaustion_raises_and_allocates_nothing(self):
        """Asking for more than is free raises PoolExhausted naming the host space."""
        pool, _ = host()
        pool.alloc(4)
        with pytest.raises(PoolExhausted) as info:
            pool.alloc(8)
        assert (info.value.space, info.value.requested, info.value.available) == ("host.full", 8, 4)
        assert pool.free_slots() == [4, 5, 6, 7]

    def test_slot_used_tracks_allocation_and_free(self):
        """slot_used is set on alloc and cleared on free; freed slots go to the tail."""
        pool, _ = host()
        slots = pool.alloc(8)
        assert pool.slot_used.tolist() == [True] * 8
        pool.free(slots[:4])
        assert pool.slot_used.tolist() == [False] * 4 + [True] * 4
        assert pool.free_slots() == [0, 1, 2, 3]
        pool.free(slots[4:])
        assert pool.free_slots() == list(range(8))

    def test_double_free_raises(self):
        """Freeing a host slot twice raises DoubleFree naming the slot, and changes nothing."""
        pool, _ = host()
        slots = pool.alloc(4)
        pool.free(slots)
        with pytest.raises(DoubleFree) as info:
            pool.free(slots)
        assert (info.value.space, info.value.slot) == ("host.full", 0)
        assert pool.available_size() == 8

    def test_duplicate_slot_in_one_free_is_a_double_free(self):
        """One free call naming a used slot twice raises DoubleFree."""
        pool, _ = host(page_size=1)
        pool.alloc(2)
        with pytest.raises(DoubleFree):
            pool.free(torch.tensor([1, 1]))
        assert pool.slot_used.tolist()[:2] == [True, True]

    def test_out_of_range_free_raises_invalid_slot(self):
        """A slot past the end of the host pool is InvalidSlot."""
        pool, _ = host()
        with pytest.raises(InvalidSlot):
            pool.free([8])

    def test_backup_from_device_and_load_to_device_round_trip(self):
        """Device rows 4..7 backed up to host 0..3 and loaded into device 12..15 arrive by position."""
        pool, dev = host()
        for layer in range(2):
            for s in range(4, 8):
                dev.k_buffer[layer][s] = 10 * layer + s
                dev.v_buffer[layer][s] = 100 + 10 * layer + s
        host_idx = pool.alloc(4)
        pool.backup_from_device(dev, host_idx, torch.arange(4, 8))
        for layer in range(2):
            dev.k_buffer[layer][4:8] = 0
        pool.load_to_device(dev, host_idx, torch.arange(12, 16))
        for layer in range(2):
            assert dev.k_buffer[layer][12:16, 0, 0].tolist() == [10 * layer + s for s in range(4, 8)]
            assert dev.v_buffer[layer][12:16, 1, 7].tolist() == [100 + 10 * layer + s for s in range(4, 8)]

    def test_free_listener_is_told_the_freed_slots(self):
        """on_free receives the space and the slots of every free."""
        pool, _ = host()
        seen = []
        pool.on_free = lambda space, slots: seen.append((space, ids(slots)))
        pool.free(pool.alloc(4))
        assert seen == [("host.full", [0, 1, 2, 3])]
