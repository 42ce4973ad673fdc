"""Triton's interpreter addresses memory as a GPU's kernel does (adapters/sglang/interpreter_bounds.py): a lane that
reads outside the tensors its launch was given reads as masked off, one that writes there raises IllegalAddress naming
the kernel, and lanes inside are untouched by the check."""

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

    return gather, scatter


def test_lanes_inside_the_launchs_tensors_read_and_write_as_the_kernel_says(kernels):
    gather, scatter = kernels
    src = torch.arange(10, 18, dtype=torch.int64)
    out = torch.zeros(4, dtype=torch.int64)
    gather[(1,)](src, torch.tensor([7, 0, 3, 3]), out, 4)
    assert out.tolist() == [17, 10, 13, 13]
    dst = torch.zeros(8, dtype=torch.int64)
    scatter[(1,)](dst, torch.tensor([1, 6, 2, 0]), torch.tensor([5, 6, 7, 8]), 4)
    assert dst.tolist() == [8, 5, 7, 0, 0, 0, 6, 0]


def test_a_lane_reading_past_its_tensor_reads_as_masked_off(kernels):
    """SGLang 0.5.10's paged alloc_extend reads its free list past the end and discards what it read; the stray lanes
    read zeros, not this process's memory (nor a SIGSEGV)."""
    gather, _ = kernels
    src = torch.arange(10, 18, dtype=torch.int64)
    out = torch.full((4,), -1, dtype=torch.int64)
    gather[(1,)](src, torch.tensor([1, 8, 1 << 40, 2]), out, 4)
    assert out.tolist() == [11, 0, 0, 12]


def test_a_lane_writing_past_its_tensor_is_an_illegal_address_naming_the_kernel(kernels):
    _, scatter = kernels
    dst = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(IllegalAddress, match=r"^Triton kernel scatter writes 8 bytes at 0x[0-9a-f]+, outside every "
                                             r"tensor it was launched with \(1 of 4 lanes\)"):
        scatter[(1,)](dst, torch.tensor([0, 1, 8, 2]), torch.tensor([5, 6, 7, 8]), 4)
