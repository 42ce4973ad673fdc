"""Triton's interpreter with a GPU's view of a stray address (adapters/sglang/interpreter_bounds.py): a lane that reads
memory the process has not mapped reads as masked off, one that writes there raises IllegalAddress naming the kernel;
lanes inside the launch's tensors, or reaching other tensors through a table of pointers, run as the kernel says."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress


@pytest.fixture(scope="module")
def kernels(api):
    """A gather and a scatter kernel, jitted after poolfuzz's shims chose the interpreter (else the test skips)."""
    if api.shims.get("triton") != "interpreter":
        pytest.skip(f"kernels are not interpreted here (triton: {api.shims.get('triton')})")
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src, index, out, n: tl.constexpr):
        lanes = tl.arange(0, n)
        tl.store(out + lanes, tl.load(src + tl.load(index + lanes)))

    @triton.jit
    def scatter(dst, index, value, n: tl.constexpr):
        lanes = tl.arange(0, n)
        tl.store(dst + tl.load(index + lanes), tl.load(value + lanes))

    @triton.jit
    def through_table(table, out, n: tl.constexpr):  # as write_req_to_token_pool_triton reads its prefix rows
        lanes = tl.arange(0, n)
        rows = tl.load(table + lanes).to(tl.pointer_type(tl.int64))
        tl.store(out + lanes, tl.load(rows + 1))

    return gather, scatter, through_table


def test_lanes_inside_the_launchs_tensors_read_and_write_as_the_kernel_says(kernels):
    gather, scatter, _ = kernels
    src = torch.arange(10, 18, dtype=torch.int64)
    out = torch.zeros(4, dtype=torch.int64)
    gather[(1,)](src, torch.tensor([7, 0, 3, 3]), out, 4)
    assert out.tolist() == [17, 10, 13, 13]
    dst = torch.zeros(8, dtype=torch.int64)
    scatter[(1,)](dst, torch.tensor([1, 6, 2, 0]), torch.tensor([5, 6, 7, 8]), 4)
    assert dst.tolist() == [8, 5, 7, 0, 0, 0, 6, 0]


def test_a_kernel_reads_tensors_it_reaches_through_a_table_of_pointers(kernels):
    """Tensors the launch was not given, named by their addresses in a table it was given: mapped memory, read as the
    kernel reads it (a bounds check on the arguments alone lost SGLang's prefix rows)."""
    *_, through_table = kernels
    rows = [torch.tensor([10 * i, 10 * i + 1, 10 * i + 2], dtype=torch.int64) for i in range(1, 5)]
    table = torch.tensor([r.data_ptr() for r in rows], dtype=torch.uint64)
    out = torch.zeros(4, dtype=torch.int64)
    through_table[(1,)](table, out, 4)
    assert out.tolist() == [11, 21, 31, 41]


def test_a_lane_reading_unmapped_memory_reads_as_masked_off(kernels):
    """SGLang 0.5.10's paged alloc_extend reads its free list past the end and discards what it read; a lane that
    lands in no mapping reads zeros (on a GPU, whatever the allocator's memory held), not a SIGSEGV."""
    gather, *_ = kernels
    src = torch.arange(10, 18, dtype=torch.int64)
    out = torch.full((4,), -1, dtype=torch.int64)
    gather[(1,)](src, torch.tensor([1, 1 << 44, 1 << 45, 2]), out, 4)
    assert out.tolist() == [11, 0, 0, 12]


def test_a_lane_writing_unmapped_memory_is_an_illegal_address_naming_the_kernel(kernels):
    _, scatter, _ = kernels
    dst = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(IllegalAddress, match=r"^Triton kernel scatter writes 8 bytes at 0x[0-9a-f]+, in no memory this "
                                             r"process has mapped writable \(1 of 4 lanes\)"):
        scatter[(1,)](dst, torch.tensor([0, 1, 1 << 44, 2]), torch.tensor([5, 6, 7, 8]), 4)
    assert dst.tolist() == [0] * 8  # the launch stopped before any lane wrote
