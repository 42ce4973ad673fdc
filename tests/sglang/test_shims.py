"""The CPU stand-ins of poolfuzz/adapters/sglang/shims.py (no SGLang needed)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from poolfuzz.adapters.sglang import shims


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, torch.cuda.synchronize is left alone")
def test_cuda_synchronize_is_a_no_op_only_inside_the_block_for_cpu_pools():
    real = torch.cuda.synchronize
    with shims.cpu_synchronize("cpu"):
        torch.cuda.synchronize()  # some releases' get_cpu_copy call it unconditionally
    assert torch.cuda.synchronize is real
    with shims.cpu_synchronize(torch.device("cpu")), pytest.raises(ValueError):
        raise ValueError  # an error inside the block still restores the real function
    assert torch.cuda.synchronize is real


def _take_stand_in_out() -> None:
    """Remove the sgl_kernel stand-in (never a real sgl_kernel) from the shims and sys.modules."""
    if shims._INSTALLED.get("sgl_kernel") == "stand-in":
        del shims._INSTALLED["sgl_kernel"]
        shims._StubFinder._roots.pop("sgl_kernel", None)
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]


@pytest.fixture
def no_sgl_kernel_afterwards():
    """Take the stand-in out again, so that a later SGLang import in this process decides for itself."""
    had = "sgl_kernel" in shims._INSTALLED
    yield
    if not had:
        _take_stand_in_out()


def test_sgl_kernel_stand_in_is_on_demand_and_never_runs_a_kernel(no_sgl_kernel_afterwards):
    assert not shims.install_on_demand("some_other_module")
    put_in = shims.install_on_demand("sgl_kernel.kvcacheio")
    if not put_in and shims._INSTALLED.get("sgl_kernel") == "real":
        pytest.skip("the real sgl_kernel imports here")
    assert not shims.install_on_demand("sgl_kernel")  # once only
    from sgl_kernel.kvcacheio import transfer_kv_per_layer  # what memory_pool_host imports

    with pytest.raises(RuntimeError, match="import-only stand-in"):
        transfer_kv_per_layer(torch.zeros(1))
    assert importlib.import_module("sgl_kernel.kvcacheio") is not None
    if put_in:  # and it comes out again whole: no trace for a later real import to trip over
        _take_stand_in_out()
        assert "sgl_kernel" not in shims._INSTALLED and "sgl_kernel" not in shims._StubFinder._roots
        assert not [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]
