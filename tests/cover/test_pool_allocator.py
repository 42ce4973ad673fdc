"""Token, paged, request-row and mamba-slot allocators: reserved slot 0, free-list order, typed errors."""

import pytest
import torch

from poolfuzz.pools import CONFIGS, build_family
from poolfuzz.pools.allocator import AllocatorState, SlotAllocator, TokenAllocator
from poolfuzz.pools.errors import DoubleFree, InvalidSlot, MisalignedAlloc, PoolExhausted
from poolfuzz.pools.mamba import MambaSlotAllocator
from poolfuzz.pools.req_to_token import ReqToTokenPool


def ids(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


def drain(alloc) -> list[int]:
    """Every token slot an allocator hands out, one page at a time, until it raises PoolExhausted."""
    out = []
    while True:
        try:
            out += ids(alloc.alloc(alloc.page_size))
        except PoolExhausted:
            return out


class TestTokenAllocatorPageSizeOne:
    def test_hands_out_slots_one_to_size_in_order(self):
        """A fresh page-size-1 allocator hands out 1..size in order and never slot 0."""
        a = TokenAllocator(size=4, page_size=1)
        assert a.free_pages() == [1, 2, 3, 4]
        assert ids(a.alloc(4)) == [1, 2, 3, 4]
        assert a.available_size() == 0

    def test_exhaustion_raises_with_space_requested_available_and_allocates_nothing(self):
        """Asking for more than is free raises PoolExhausted naming the space and takes no slot."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(3)  # free list now [4]
        with pytest.raises(PoolExhausted) as info:
            a.alloc(2)
        assert (info.value.space, info.value.requested, info.value.available) == ("full", 2, 1)
        assert "full pool exhausted: requested 2, available 1" in str(info.value)
        assert a.free_pages() == [4]

    def test_freed_slots_go_to_the_tail(self):
        """Page size 1 appends freed slots at the tail, so reuse is FIFO."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(4)
        a.free([3])
        a.free([1])
        # Freed in the order 3, 1: both append, so 3 is handed out first.
        assert a.free_pages() == [3, 1]
        assert ids(a.alloc(1)) == [3]

    def test_free_leaves_free_list_order_of_older_slots(self):
        """A slot freed after others were freed earlier lands behind them."""
        a = TokenAllocator(size=5, page_size=1)
        a.alloc(3)  # free list [4, 5]
        a.free([2])
        assert a.free_pages() == [4, 5, 2]

    def test_double_free_raises(self):
        """Freeing a slot that is already free raises DoubleFree naming the slot."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(2)
        a.free([2])
        with pytest.raises(DoubleFree) as info:
            a.free([2])
        assert (info.value.space, info.value.slot) == ("full", 2)
        assert a.free_pages() == [3, 4, 2]

    def test_double_free_of_never_allocated_slot_raises(self):
        """Freeing a slot that was never handed out is a DoubleFree too."""
        a = TokenAllocator(size=4, page_size=1)
        with pytest.raises(DoubleFree):
            a.free([3])

    def test_freeing_slot_zero_raises_invalid_slot(self):
        """Slot 0 is padding: freeing it raises InvalidSlot and changes nothing."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(4)
        with pytest.raises(InvalidSlot) as info:
            a.free([0])
        assert info.value.slot == 0
        assert "padding" in str(info.value)
        assert a.available_size() == 0

    def test_freeing_out_of_range_raises_invalid_slot(self):
        """A slot past the end of the pool is InvalidSlot, not a silent no-op."""
        a = TokenAllocator(size=4, page_size=1)
        with pytest.raises(InvalidSlot, match="out of range"):
            a.free([5])

    def test_free_with_a_bad_slot_frees_nothing(self):
        """A free that contains one bad slot releases none of the good ones."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(4)
        a.free([1])
        with pytest.raises(DoubleFree) as info:
            a.free([2, 1])  # 1 is already free; 2 must stay allocated
        assert info.value.slot == 1
        assert a.free_pages() == [1]

    def test_duplicate_slots_in_one_free_collapse(self):
        """One free call naming a slot twice frees it once."""
        a = TokenAllocator(size=4, page_size=1)
        a.alloc(2)
        a.free(torch.tensor([2, 2]))
        assert a.free_pages() == [3, 4, 2]

    def test_empty_free_is_a_no_op(self):
        """Freeing an empty index list does nothing."""
        a = TokenAllocator(size=2, page_size=1)
        a.free([])
        assert a.free_pages() == [1, 2]

    def test_alloc_extend_from_empty_prefix(self):
        """alloc_extend with no prefix takes fresh slots for every position."""
        a = TokenAllocator(size=8, page_size=1)
        assert ids(a.alloc_extend(prefix_len=0, seq_len=3, last_loc=-1)) == [1, 2, 3]
        assert ids(a.alloc_extend(prefix_len=3, seq_len=5, last_loc=3)) == [4, 5]
        assert ids(a.alloc_extend(prefix_len=5, seq_len=5, last_loc=5)) == []

    def test_clear_rebuilds_the_free_list(self):
        """clear forgets every allocation and restores the order 1..size."""
        a = TokenAllocator(size=3, page_size=1)
        a.alloc(2)
        a.free([1])
        a.clear()
        assert a.free_pages() == [1, 2, 3]


class TestPagedAllocator:
    def test_hands_out_whole_pages_and_never_page_zero(self):
        """Page size 4, 3 pages: slots 4..15, never the padding slots 0..3."""
        a = TokenAllocator(size=12, page_size=4)
        assert a.num_pages == 3
        assert a.free_pages() == [1, 2, 3]
        assert ids(a.alloc(8)) == [4, 5, 6, 7, 8, 9, 10, 11]
        assert a.available_size() == 4

    def test_alloc_of_non_page_multiple_raises_misaligned(self):
        """alloc(n) needs n to be whole pages."""
        a = TokenAllocator(size=12, page_size=4)
        with pytest.raises(MisalignedAlloc):
            a.alloc(3)
        assert a.free_pages() == [1, 2, 3]

    def test_size_not_a_page_multiple_is_rejected(self):
        """A pool whose size is not a whole number of pages cannot be built."""
        with pytest.raises(MisalignedAlloc):
            TokenAllocator(size=10, page_size=4)

    def test_exhaustion_reports_tokens_not_pages(self):
        """PoolExhausted counts requested and available in token slots."""
        a = TokenAllocator(size=12, page_size=4, space="swa")
        a.alloc(8)
        with pytest.raises(PoolExhausted) as info:
            a.alloc(8)
        assert (info.value.space, info.value.requested, info.value.available) == ("swa", 8, 4)
        assert a.free_pages() == [3]

    def test_freeing_any_token_frees_its_whole_page(self):
        """Freeing slot 5 releases page 1 (slots 4..7) entirely."""
        a = TokenAllocator(size=12, page_size=4)
        a.alloc(12)
        a.free([5])
        assert a.free_pages() == [1]
        assert a.available_size() == 4
        with pytest.raises(DoubleFree) as info:
            a.free([7])  # same page
        assert info.value.slot == 4

    def test_freed_pages_go_to_the_front(self):
        """Freed pages are handed out next, most recently freed first."""
        a = TokenAllocator(size=16, page_size=4)
        a.alloc(12)  # pages 1, 2, 3 taken; free list [4]
        a.free([5])  # page 1 to the front
        assert a.free_pages() == [1, 4]
        a.free([9, 10])  # page 2 to the front
        assert a.free_pages() == [2, 1, 4]
        # Several pages freed at once keep ascending order at the front.
        a.alloc(12)
        a.free([12, 4])  # pages 3 and 1
        assert a.free_pages() == [1, 3]
        assert ids(a.alloc(4)) == [4, 5, 6, 7]

    def test_freeing_padding_page_raises_invalid_slot(self):
        """Any slot of page 0 is padding: freeing slot 2 raises InvalidSlot for slot 0."""
        a = TokenAllocator(size=8, page_size=4)
        with pytest.raises(InvalidSlot) as info:
            a.free([2])
        assert info.value.slot == 0

    def test_alloc_extend_fills_the_current_page_before_new_pages(self):
        """Positions 2..6 after a prefix of 2 on slots 4, 5: first 6, 7, then page 2 (8, 9, 10)."""
        a = TokenAllocator(size=16, page_size=4)
        first = a.alloc_extend(prefix_len=0, seq_len=2, last_loc=-1)
        assert ids(first) == [4, 5]
        rest = a.alloc_extend(prefix_len=2, seq_len=7, last_loc=5)
        assert ids(rest) == [6, 7, 8, 9, 10]
        assert a.free_pages() == [3, 4]

    def test_alloc_extend_within_the_current_page_takes_no_new_page(self):
        """Growing 5 -> 7 positions stays on the page of slot 8 (positions 4..7)."""
        a = TokenAllocator(size=16, page_size=4)
        a.alloc_extend(prefix_len=0, seq_len=5, last_loc=-1)  # slots 4..8
        assert ids(a.alloc_extend(prefix_len=5, seq_len=7, last_loc=8)) == [9, 10]
        assert a.free_pages() == [3, 4]

    def test_alloc_extend_from_a_page_boundary_takes_new_pages_only(self):
        """A prefix that ends on a page boundary continues on a fresh page."""
        a = TokenAllocator(size=16, page_size=4)
        a.alloc_extend(prefix_len=0, seq_len=4, last_loc=-1)  # slots 4..7
        assert ids(a.alloc_extend(prefix_len=4, seq_len=6, last_loc=7)) == [8, 9]

    def test_alloc_extend_with_a_wrong_last_loc_gives_the_pages_back(self):
        """A last_loc whose page offset disagrees with prefix_len raises MisalignedAlloc and allocates nothing."""
        a = TokenAllocator(size=16, page_size=4)
        a.alloc_extend(prefix_len=0, seq_len=2, last_loc=-1)  # slots 4, 5; free [2, 3, 4]
        with pytest.raises(MisalignedAlloc):
            a.alloc_extend(prefix_len=2, seq_len=7, last_loc=6)
        assert a.free_pages() == [2, 3, 4]

    def test_alloc_extend_exhaustion_allocates_nothing(self):
        """alloc_extend that needs more pages than are free raises before taking any."""
        a = TokenAllocator(size=8, page_size=4)
        a.alloc_extend(prefix_len=0, seq_len=2, last_loc=-1)  # page 1; free [2]
        with pytest.raises(PoolExhausted) as info:
            a.alloc_extend(prefix_len=2, seq_len=13, last_loc=5)  # needs pages 4 - 1 = 3
        assert (info.value.requested, info.value.available) == (12, 4)
        assert a.free_pages() == [2]

    def test_pages_needed(self):
        """pages_needed counts pages of the sequence minus pages the prefix already has."""
        a = TokenAllocator(size=16, page_size=4)
        assert a.pages_needed(prefix_len=0, seq_len=1) == 1
        assert a.pages_needed(prefix_len=2, seq_len=7) == 1
        assert a.pages_needed(prefix_len=4, seq_len=9) == 2
        assert a.pages_needed(prefix_len=5, seq_len=8) == 0


class TestAllocatorSnapshots:
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_backup_then_restore_round_trips(self, page_size):
        """restore_state puts back exactly the free list backup_state saw."""
        a = TokenAllocator(size=4 * page_size, page_size=page_size)
        a.alloc(page_size)
        state = a.backup_state()
        assert state == AllocatorState(free_pages=(2, 3, 4))
        a.alloc(2 * page_size)
        a.free([page_size])  # page 1
        a.restore_state(state)
        assert a.free_pages() == [2, 3, 4]
        assert not a.is_free_page(1)
        assert a.is_free_page(2)

    def test_backup_is_a_value_copy(self):
        """Allocating and freeing after a backup does not change the saved state."""
        a = TokenAllocator(size=4, page_size=1)
        state = a.backup_state()
        a.alloc(3)
        a.free([2])
        assert state.free_pages == (1, 2, 3, 4)
        a.restore_state(state)
        a.alloc(4)  # using the restored list must not mutate the snapshot either
        assert state.free_pages == (1, 2, 3, 4)
        a.restore_state(state)
        assert a.free_pages() == [1, 2, 3, 4]

    def test_restore_restores_double_free_detection(self):
        """After a restore, pages the snapshot held allocated are allocated again."""
        a = TokenAllocator(size=3, page_size=1)
        a.alloc(1)
        state = a.backup_state()
        a.free([1])
        a.restore_state(state)
        a.free([1])  # held in the snapshot, so this free is legal
        with pytest.raises(DoubleFree):
            a.free([1])


class TestSlotAllocators:
    def test_request_rows_never_hand_out_row_zero(self):
        """Rows are 1..size; the padding row 0 is never handed out."""
        pool = ReqToTokenPool(size=3, max_context=4, device="cpu")
        assert [pool.alloc() for _ in range(3)] == [1, 2, 3]
        with pytest.raises(PoolExhausted) as info:
            pool.alloc()
        assert (info.value.space, info.value.requested, info.value.available) == ("rows", 1, 0)

    def test_request_rows_are_reused_fifo(self):
        """A freed row is appended: the next alloc takes the oldest free row."""
        pool = ReqToTokenPool(size=3, max_context=4, device="cpu")
        pool.alloc()
        pool.alloc()  # free list [3]
        pool.free(1)
        assert pool.alloc() == 3
        assert pool.alloc() == 1

    def test_request_row_double_free_and_row_zero(self):
        """Freeing a free row is DoubleFree; freeing row 0 is InvalidSlot."""
        pool = ReqToTokenPool(size=2, max_context=4, device="cpu")
        row = pool.alloc()
        pool.free(row)
        with pytest.raises(DoubleFree):
            pool.free(row)
        with pytest.raises(InvalidSlot):
            pool.free(0)

    def test_request_row_write_to_row_zero_raises(self):
        """Writing slots into the padding row raises InvalidSlot."""
        pool = ReqToTokenPool(size=2, max_context=4, device="cpu")
        with pytest.raises(InvalidSlot, match="padding row"):
            pool.write(0, 0, torch.tensor([1, 2]))

    def test_request_row_read_write(self):
        """write stores int32 slots and read returns them as int64."""
        pool = ReqToTokenPool(size=2, max_context=6, device="cpu")
        row = pool.alloc()
        pool.write(row, 1, torch.tensor([7, 8, 9]))
        out = pool.read(row, 0, 5)
        assert out.dtype == torch.int64
        assert ids(out) == [0, 7, 8, 9, 0]
        assert pool.req_to_token.dtype == torch.int32

    def test_mamba_slots_never_hand_out_slot_zero(self):
        """Mamba slots are 1..size; exhaustion names the mamba space."""
        a = MambaSlotAllocator(size=2)
        assert [a.alloc_one(), a.alloc_one()] == [1, 2]
        with pytest.raises(PoolExhausted) as info:
            a.alloc_one()
        assert (info.value.space, info.value.requested, info.value.available) == ("mamba", 1, 0)
        with pytest.raises(InvalidSlot):
            a.free([0])
        a.free([2])
        with pytest.raises(DoubleFree):
            a.free([2])

    def test_slot_allocator_is_page_size_one(self):
        """SlotAllocator is a page-size-1 free list in its own named space."""
        a = SlotAllocator(size=3, space="rows")
        assert (a.page_size, a.space, a.free_pages()) == (1, "rows", [1, 2, 3])


class TestEveryFamilyAllocatorReservesSlotZero:
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_draining_every_allocator_never_yields_padding(self, name):
        """Exhausting each device allocator of every config yields exactly slots ps..(pages+1)*ps-1."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode="cpu_tensor")
        for space, alloc in family.free_lists().items():
            ps = alloc.page_size
            got = drain(alloc)
            assert sorted(got) == list(range(ps, (alloc.num_pages + 1) * ps)), space
            assert not set(range(ps)) & set(got), space
            assert alloc.available_size() == 0
