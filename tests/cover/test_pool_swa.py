"""SWA allocator: full and SWA sub-allocators joined by the full->SWA mapping (0 = unmapped, trailing -1)."""

import pytest
import torch

from poolfuzz.pools.errors import DoubleFree, PoolExhausted
from poolfuzz.pools.swa_allocator import SWATokenAllocator


def ids(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


def paged() -> SWATokenAllocator:
    """Page size 4: full pages 1..4 (slots 4..19), SWA pages 1..2 (slots 4..11); mapping of 16+4+1 entries."""
    return SWATokenAllocator(size=16, size_swa=8, page_size=4)


class TestSWAMapping:
    def test_fresh_mapping_is_zeros_with_trailing_minus_one(self):
        """The mapping has size+page_size+1 entries: all 0 (unmapped) except the last, -1."""
        a = paged()
        assert a.full_to_swa.dtype == torch.int64
        assert ids(a.full_to_swa) == [0] * 20 + [-1]

    def test_minus_one_translates_to_minus_one(self):
        """A last_loc of -1 (no prefix) translates to -1 through the trailing entry."""
        a = paged()
        assert ids(a.translate(torch.tensor([-1]))) == [-1]

    def test_sizes(self):
        """size and available_size are the smaller side; each side also reports on its own."""
        a = paged()
        assert (a.size, a.available_size()) == (8, 8)
        assert (a.full_available_size(), a.swa_available_size()) == (16, 8)
        assert set(a.sub_allocators()) == {"full", "swa"}


class TestSWAAlloc:
    def test_alloc_maps_full_slots_to_swa_slots(self):
        """Page size 1: alloc(3) takes full 1..3 and SWA 1..3 and maps each pair."""
        a = SWATokenAllocator(size=6, size_swa=4, page_size=1)
        full = a.alloc(3)
        assert ids(full) == [1, 2, 3]
        assert ids(a.full_to_swa) == [0, 1, 2, 3, 0, 0, 0, -1]  # 6 + 1 + 1 entries

    def test_alloc_keeps_page_offsets_equal(self):
        """Full slot t and its SWA slot sit at the same offset within their pages."""
        a = paged()
        first = a.alloc(4)  # full page 1 -> SWA page 1
        a.free_swa(first)  # SWA page 1 back to the front
        second = a.alloc(4)  # full page 2 (slots 8..11) -> SWA page 1 (slots 4..7)
        assert ids(second) == [8, 9, 10, 11]
        assert ids(a.translate(second)) == [4, 5, 6, 7]
        assert all(t % 4 == s % 4 for t, s in zip(ids(second), ids(a.translate(second))))

    def test_alloc_extend_continues_the_swa_page_of_last_loc(self):
        """alloc_extend fills the current page on both sides, via the translated last_loc."""
        a = paged()
        a.alloc(4)
        a.free_swa(torch.tensor([4]))  # full page 1 keeps its slots; SWA page 1 free again
        head = a.alloc_extend(prefix_len=0, seq_len=2, last_loc=-1)  # full page 2, SWA page 1
        assert ids(head) == [8, 9]
        assert ids(a.translate(head)) == [4, 5]
        tail = a.alloc_extend(prefix_len=2, seq_len=6, last_loc=9)  # 10, 11, then full page 3 / SWA page 2
        assert ids(tail) == [10, 11, 12, 13]
        assert ids(a.translate(tail)) == [6, 7, 8, 9]

    def test_swa_exhaustion_names_swa_and_allocates_nothing(self):
        """When the SWA side is short, PoolExhausted names swa and neither side changes."""
        a = paged()
        a.alloc(8)  # SWA side now empty, full side has pages 3, 4
        with pytest.raises(PoolExhausted) as info:
            a.alloc(4)
        assert (info.value.space, info.value.requested, info.value.available) == ("swa", 4, 0)
        assert a.full.free_pages() == [3, 4]
        with pytest.raises(PoolExhausted) as info:
            a.alloc_extend(prefix_len=0, seq_len=1, last_loc=-1)
        assert info.value.space == "swa"
        assert a.full.free_pages() == [3, 4]

    def test_full_exhaustion_is_checked_first(self):
        """With both sides short, the full side is named."""
        a = SWATokenAllocator(size=4, size_swa=4, page_size=1)
        a.alloc(4)
        with pytest.raises(PoolExhausted) as info:
            a.alloc(1)
        assert info.value.space == "full"


class TestSWAFree:
    def test_free_swa_of_one_token_frees_and_unmaps_the_whole_page(self):
        """Paged free_swa widens to whole pages: slot 5 unmaps full slots 4..7 and frees SWA page 1."""
        a = paged()
        full = a.alloc(8)  # full 4..11 -> SWA 4..11
        a.free_swa(torch.tensor([5]))
        assert ids(a.translate(full)) == [0, 0, 0, 0, 8, 9, 10, 11]
        assert a.swa.free_pages() == [1]
        assert a.full.free_pages() == [3, 4]  # the full side keeps its slots

    def test_second_free_swa_frees_nothing(self):
        """free_swa of already unmapped slots is a no-op: zeroing the mapping stops the double free."""
        a = paged()
        full = a.alloc(8)
        a.free_swa(full[:4])
        a.free_swa(full[:4])
        assert a.swa.free_pages() == [1]
        assert a.swa_available_size() == 4

    def test_free_after_free_swa_frees_full_only(self):
        """free of a window-evicted range releases the full pages and no SWA page twice."""
        a = paged()
        full = a.alloc(8)
        a.free_swa(full[:4])
        a.free(full)
        assert a.full.free_pages() == [1, 2, 3, 4]
        assert a.swa.free_pages() == [2, 1]
        assert ids(a.full_to_swa) == [0] * 20 + [-1]

    def test_free_twice_raises_double_free(self):
        """free is not idempotent: a second free raises DoubleFree on the full side."""
        a = SWATokenAllocator(size=6, size_swa=4, page_size=1)
        full = a.alloc(2)
        a.free(full)
        with pytest.raises(DoubleFree) as info:
            a.free(full)
        assert info.value.space == "full"
        assert (a.full_available_size(), a.swa_available_size()) == (6, 4)

    def test_free_page_size_one_appends_on_both_sides(self):
        """Page size 1 returns full and SWA slots to the tails of their lists."""
        a = SWATokenAllocator(size=4, size_swa=4, page_size=1)
        full = a.alloc(3)
        a.free(full[1:2])
        assert a.full.free_pages() == [4, 2]
        assert a.swa.free_pages() == [4, 2]
        assert ids(a.full_to_swa) == [0, 1, 0, 3, 0, -1]  # 4 + 1 + 1 entries


class TestSWATailAlloc:
    def test_tail_alloc_maps_only_the_tail_and_zeroes_the_head(self):
        """seq 10, tail 6, page 4: full slots 4..13; head 4..7 -> 0 even if stale; 8..13 -> SWA 4..9."""
        a = paged()
        state = a.backup_state()
        a.alloc(4)  # maps full 4..7 -> SWA 4..7
        a.restore_state(state)  # free lists back; the mapping keeps its stale entries
        full = a.alloc_extend_swa_tail(seq_len=10, swa_tail_len=6)
        assert ids(full) == list(range(4, 14))
        assert ids(a.translate(full)) == [0, 0, 0, 0, 4, 5, 6, 7, 8, 9]
        assert a.full.free_pages() == [4]
        assert a.swa.free_pages() == []

    def test_tail_alloc_checks_the_swa_tail_only(self):
        """The SWA side needs pages for the tail only, so a short SWA pool still fits."""
        a = SWATokenAllocator(size=16, size_swa=4, page_size=4)
        full = a.alloc_extend_swa_tail(seq_len=12, swa_tail_len=4)
        assert ids(a.translate(full))[:8] == [0] * 8
        assert ids(a.translate(full))[8:] == [4, 5, 6, 7]
        with pytest.raises(PoolExhausted) as info:
            a.alloc_extend_swa_tail(seq_len=4, swa_tail_len=4)
        assert (info.value.space, info.value.available) == ("swa", 0)


class TestSWAClearAndSnapshots:
    def test_clear_zeroes_the_mapping_and_keeps_the_trailing_minus_one(self):
        """clear frees both sides and resets the mapping to zeros followed by -1."""
        a = paged()
        a.alloc(8)
        a.clear()
        assert ids(a.full_to_swa) == [0] * 20 + [-1]
        assert (a.full.free_pages(), a.swa.free_pages()) == ([1, 2, 3, 4], [1, 2])

    def test_backup_state_covers_both_free_lists(self):
        """backup_state/restore_state round-trip the full and SWA free lists."""
        a = paged()
        state = a.backup_state()
        a.alloc(8)
        a.restore_state(state)
        assert (a.full.free_pages(), a.swa.free_pages()) == ([1, 2, 3, 4], [1, 2])

    def test_backup_state_does_not_cover_the_mapping(self):
        """After restore_state the mapping still holds entries written after the backup (SGLang's hazard)."""
        a = paged()
        state = a.backup_state()
        full = a.alloc(4)
        a.restore_state(state)
        assert ids(a.translate(full)) == [4, 5, 6, 7]


class TestFailedExtendAllocatesNothing:
    def test_failed_swa_extend_gives_back_the_full_pages(self):
        """A MisalignedAlloc from the SWA side leaves the full side unchanged."""
        from poolfuzz.pools.errors import MisalignedAlloc
        from poolfuzz.pools.swa_allocator import SWATokenAllocator

        a = SWATokenAllocator(size=16, size_swa=8, page_size=4)
        f = a.alloc_extend(prefix_len=0, seq_len=2, last_loc=-1)  # full 4,5 -> SWA 4,5
        a.free_swa(f)  # the last position is unmapped now
        with pytest.raises(MisalignedAlloc):
            a.alloc_extend(prefix_len=2, seq_len=7, last_loc=5)
        assert a.full.free_pages() == [2, 3, 4]
