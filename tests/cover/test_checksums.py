"""Per-slot checksums: exact, deterministic, position-sensitive, for every component dtype."""

import pytest
import torch

from poolfuzz.harness.checksums import _weights, as_words, row_checksums, slot_checksums

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _rows(dtype, n=6, width=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g).to(dtype)


def _exact_python(rows: torch.Tensor) -> list[int]:
    """The checksum computed with Python integers, as the float64 path must reproduce exactly."""
    words = as_words(rows)
    w = _weights(words.shape[1], torch.device("cpu")).to(torch.int64)
    out = []
    for row in words.tolist():
        lanes = [sum(x * int(w[j, lane]) for j, x in enumerate(row)) for lane in (0, 1)]
        value = (lanes[0] * 0x100000001B3 + lanes[1]) % (1 << 64)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


class TestRowChecksums:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_matches_exact_integer_arithmetic(self, dtype):
        """The float64 dot product equals the checksum computed in exact Python integers."""
        rows = _rows(dtype)
        assert row_checksums(rows).tolist() == _exact_python(rows)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_equal_rows_equal_checksums_and_deterministic(self, dtype):
        """The same bytes give the same checksum, run after run."""
        rows = _rows(dtype)
        assert torch.equal(row_checksums(rows), row_checksums(rows.clone()))

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_swapping_two_values_in_a_row_changes_it(self, dtype):
        """Position sensitivity: a permuted row is not the same row."""
        rows = _rows(dtype, n=1)
        rows[0, 0], rows[0, 5] = 3, 200
        swapped = rows.clone()
        swapped[0, 0], swapped[0, 5] = rows[0, 5], rows[0, 0]
        assert row_checksums(rows)[0] != row_checksums(swapped)[0]

    def test_shifted_row_changes_it(self):
        """A row shifted by one element (a torn or misaligned copy) checksums differently."""
        rows = _rows(torch.bfloat16, n=1)
        shifted = torch.roll(rows, 1, dims=1)
        assert row_checksums(rows)[0] != row_checksums(shifted)[0]

    def test_every_single_bit_flip_is_seen(self):
        """Flipping any one bit of a row changes its checksum."""
        row = _rows(torch.uint8, n=1, width=16)
        base = int(row_checksums(row)[0])
        for byte in range(16):
            for bit in range(8):
                flipped = row.clone()
                flipped[0, byte] ^= 1 << bit
                assert int(row_checksums(flipped)[0]) != base, (byte, bit)

    def test_odd_byte_rows_are_supported(self):
        """uint8 rows with an odd number of bytes are widened instead of reinterpreted."""
        rows = _rows(torch.uint8, width=15)
        assert row_checksums(rows).shape == (6,)
        assert row_checksums(rows).tolist() == _exact_python(rows)

    def test_multidimensional_rows(self):
        """A slot's row may be [heads, head_dim] or a mamba state shape; it is flattened."""
        rows = _rows(torch.float32, n=4, width=32).reshape(4, 2, 4, 4)
        assert torch.equal(row_checksums(rows), row_checksums(rows.reshape(4, 32)))


class TestSlotChecksums:
    def test_gathers_the_named_slots(self):
        """slot_checksums(buffer, slots) == checksums of buffer[slots], in the order given."""
        buf = _rows(torch.bfloat16, n=10).reshape(10, 2, 8)
        slots = torch.tensor([7, 2, 7])
        assert torch.equal(slot_checksums(buf, slots), row_checksums(buf[slots]))

    def test_row_in_the_wrong_slot_is_caught(self):
        """Two slots with swapped rows no longer match their expected checksums."""
        buf = _rows(torch.float16, n=4).reshape(4, 2, 8)
        expected = slot_checksums(buf, torch.tensor([1, 2]))
        buf[[1, 2]] = buf[[2, 1]]
        got = slot_checksums(buf, torch.tensor([1, 2]))
        assert (got != expected).all()

    def test_no_slots(self):
        """An empty slot list gives an empty result."""
        buf = torch.zeros(4, 2, 8)
        assert slot_checksums(buf, torch.empty(0, dtype=torch.int64)).numel() == 0
