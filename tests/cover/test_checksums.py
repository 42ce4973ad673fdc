"""Per-slot checksums: exact, deterministic, position-sensitive, for every component dtype."""

import pytest
import torch

from poolfuzz.harness.checksums import (
    SlotReader,
    _np_weights,
    _torch_checksums,
    _weights,
    as_words,
    reference_checksums,
    row_checksums,
    slot_checksums,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _rows(dtype, n=6, width=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g).to(dtype)


def _exact_python(rows: torch.Tensor) -> list[int]:
    """The definition, written out here independently of the module: little-endian 64-bit words
    of the zero-padded row bytes, times odd weights, summed mod 2**64, as a signed int64."""
    raw = rows.reshape(rows.shape[0], -1).contiguous().view(torch.uint8).tolist()
    out = []
    for row in raw:
        data = bytes(row) + bytes(-len(row) % 8)
        words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
        w = [int(v) for v in _np_weights(len(words))]
        value = sum(x * wj for x, wj in zip(words, w)) % (1 << 64)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


class TestRowChecksums:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_matches_exact_integer_arithmetic(self, dtype):
        """The vectorized checksum equals the definition computed in exact Python integers."""
        rows = _rows(dtype)
        assert row_checksums(rows).tolist() == _exact_python(rows) == reference_checksums(rows)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("nbytes", [4, 12, 16, 36, 4096])
    def test_device_formulation_agrees_bit_for_bit(self, dtype, nbytes):
        """The torch int64 path (what CUDA runs) and the numpy path (CPU) give the same bits, for
        rows that are or are not a multiple of 8 bytes and whose words have their high bits set."""
        g = torch.Generator().manual_seed(nbytes)
        raw = torch.randint(0, 256, (7, nbytes), generator=g, dtype=torch.uint8)
        rows = raw.view(dtype)
        assert torch.equal(_torch_checksums(as_words(rows)), row_checksums(rows))
        assert row_checksums(rows).tolist() == _exact_python(rows)

    @pytest.mark.parametrize(("dtype", "nbytes"), [(torch.bfloat16, 4096), (torch.uint8, 4092)], ids=str)
    def test_large_inputs_take_the_bulk_path_and_agree(self, dtype, nbytes):
        """At 2^15 words and up the CPU path switches formulation (einsum); it gives the same bits."""
        g = torch.Generator().manual_seed(nbytes)
        rows = torch.randint(0, 256, (80, nbytes), generator=g, dtype=torch.uint8).view(dtype)
        assert as_words(rows).numel() >= 1 << 15
        assert row_checksums(rows).tolist() == reference_checksums(rows)
        assert torch.equal(_torch_checksums(as_words(rows)), row_checksums(rows))

    def test_device_path_in_many_chunks(self, monkeypatch):
        """The device path sums chunk by chunk; any chunking gives the same bits."""
        import poolfuzz.harness.checksums as checksums

        rows = torch.randint(0, 256, (37, 4096), dtype=torch.uint8)
        whole = _torch_checksums(as_words(rows))
        monkeypatch.setattr(checksums, "_CUDA_CHUNK_BYTES", 3 * 4096)
        assert torch.equal(_torch_checksums(as_words(rows)), whole)
        assert torch.equal(whole, row_checksums(rows))

    def test_weights_are_odd_and_independent_of_row_length(self):
        """Word j has the same odd weight in a row of any length, on every device."""
        short, long = _np_weights(4), _np_weights(64)
        assert (long[:4] == short).all() and (long & 1 == 1).all()
        assert torch.equal(_weights(64, "cpu"), torch.from_numpy(long.view("int64").copy()))

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

    @pytest.mark.parametrize("width", [16, 13])
    def test_every_single_bit_flip_is_seen(self, width):
        """Flipping any one bit of a row changes its checksum (all flips checked in one batch)."""
        row = _rows(torch.uint8, n=1, width=width)
        flips = row.repeat(width * 8, 1)
        for byte in range(width):
            for bit in range(8):
                flips[byte * 8 + bit, byte] ^= 1 << bit
        assert (row_checksums(flips) != row_checksums(row)[0]).all()

    def test_swapping_any_two_elements_changes_it(self):
        """Every transposition of two distinct bf16 values of a KV-sized row is seen."""
        row = _rows(torch.bfloat16, n=1, width=16)[0]
        base = int(row_checksums(row[None])[0])
        swapped = []
        for i in range(16):
            for j in range(i + 1, 16):
                if row[i] != row[j]:
                    s = row.clone()
                    s[i], s[j] = row[j], row[i]
                    swapped.append(s)
        assert (row_checksums(torch.stack(swapped)) != base).all()

    def test_rows_in_swapped_slots_are_caught(self):
        """Two different rows exchanged between slots no longer match the slots' checksums."""
        rows = _rows(torch.bfloat16, n=2, width=16)
        assert (row_checksums(rows.flip(0)) != row_checksums(rows)).all()

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

    @pytest.mark.parametrize("shape", [(10, 2, 8), (10, 6, 3), (10, 15)])
    def test_slot_reader_matches_gather(self, shape):
        """SlotReader (numpy view on CPU, or the padded path) equals checksumming the gather."""
        buf = torch.randint(0, 256, shape).to(torch.bfloat16 if shape[-1] != 15 else torch.uint8)
        reader = SlotReader(buf)
        for slots in ([3, 0, 9, 3], []):
            idx = torch.tensor(slots, dtype=torch.int64)
            assert torch.equal(reader(idx), row_checksums(buf[idx]))

    def test_slot_reader_sees_later_writes(self):
        """The reader views the buffer, it does not snapshot it."""
        buf = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
        reader = SlotReader(buf)
        before = reader(torch.tensor([2]))
        buf[2, 0, 0] = 1
        assert not torch.equal(reader(torch.tensor([2])), before)

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


@pytest.mark.requires_cuda
class TestOnCuda:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("nbytes", [16, 36, 4096])
    def test_cuda_and_cpu_agree_bit_for_bit(self, dtype, nbytes):
        """The ledger computes expected checksums on the CPU; the device must produce the same bits."""
        g = torch.Generator().manual_seed(nbytes)
        rows = torch.randint(0, 256, (33, nbytes), generator=g, dtype=torch.uint8).view(dtype)
        assert torch.equal(row_checksums(rows.cuda()).cpu(), row_checksums(rows))

    def test_slot_reader_on_cuda(self):
        """Gathering and checksumming named slots on the device equals the CPU computation."""
        buf = torch.randint(0, 256, (64, 6, 6), dtype=torch.uint8).view(torch.bfloat16)
        slots = torch.tensor([5, 0, 63, 5])
        assert torch.equal(SlotReader(buf.cuda())(slots).cpu(), SlotReader(buf)(slots))

    def test_large_buffer_in_chunks(self):
        """A buffer larger than one device chunk gives the CPU's checksums."""
        rows = torch.randint(0, 256, ((40 << 20) // 4096, 4096), dtype=torch.uint8)
        assert torch.equal(row_checksums(rows.cuda()).cpu(), row_checksums(rows))
