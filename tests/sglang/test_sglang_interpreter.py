"""Releases whose paged allocator only launches Triton kernels run their paged configs on the CPU, in
Triton's interpreter, where the real triton wheel is installed and no GPU is visible."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS


@pytest.fixture
def kernel_only(api):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: kernels compile, nothing is interpreted")
    if not api.paged_kernels:
        pytest.skip(f"sglang {api.version}'s paged allocator launches no Triton kernel here "
                    f"(triton: {api.shims.get('triton')})")
    return api


def test_kernels_are_interpreted_and_every_paged_config_is_supported(kernel_only):
    from poolfuzz.adapters.sglang import describe
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason

    assert kernel_only.kernels_interpreted and describe()["kernels_interpreted"]
    assert {"alloc_extend_kernel", "alloc_decode_kernel"} & set(kernel_only.paged_kernels)
    # Every paged config of the shapes every release builds (MHA; MLA/DSA/scaled/extra-buffer pools and KV
    # quant methods are declined for reasons of their own, tested in test_sglang_storage.py).
    paged = {name: c for name, c in CONFIGS.items() if c.page_size > 1 and c.attention == "mha"
             and not c.kv_scale_block and not c.mamba_track_slots and not c.spec_draft_tokens and not c.kv_quant}
    assert len(paged) >= 4
    reasons = {name: unsupported_reason(c) for name, c in paged.items()}
    # none declined for the interpreter; a model with recurrent state may be refused by the release's own server
    # validation (0.5.23: "no_buffer only supports page_size=1"), which is SGLang's answer, not the kernels'
    refused = {name: why for name, why in reasons.items() if why is not None}
    assert all(paged[name].has_mamba and "SGLang refuses" in why for name, why in refused.items()), refused
    assert sum(1 for name, c in paged.items() if not c.has_mamba and reasons[name] is None) >= 2


def test_interpreted_kernels_hand_out_whole_pages_and_a_full_pool_is_refused(kernel_only):
    """SGLang's own paged allocator of a server, its kernels interpreted: an extend takes whole pages from a page
    boundary, a decode goes on in the same page, and an extend past what is free gets nothing and takes nothing."""
    from poolfuzz.adapters.sglang.pools.calls import paged_alloc_extend
    from poolfuzz.adapters.sglang.pools.views import as_ints
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    fam = build_driver(CONFIGS["dense-ps4"]).family
    alloc, ps = fam.sg_allocator, fam.config.page_size
    slots = as_ints(paged_alloc_extend(alloc, prefix_len=0, seq_len=6, last_loc=-1))  # alloc_extend_kernel
    assert len(slots) == 6 and slots[0] % ps == 0 and slots == list(range(slots[0], slots[0] + 6))
    more = as_ints(paged_alloc_extend(alloc, prefix_len=6, seq_len=7, last_loc=slots[-1]))
    assert more == [slots[-1] + 1]  # the same page goes on
    before = alloc.available_size()
    assert paged_alloc_extend(alloc, prefix_len=0, seq_len=before + ps, last_loc=-1) is None  # refused, none taken
    assert alloc.available_size() == before


def test_a_run_on_interpreted_kernels_ends_without_the_native_modules_leak_noise(kernel_only, tmp_path):
    """Triton's native module reports its objects as leaked while the interpreter finalizes (nanobind, a hundred
    lines on stderr); the command line closes stderr for that last stage, after the run has reported."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "run", "--family", "sglang", "--config", "dense-ps4",
                          "--examples", "2", "--seed", "1", "--db", "none", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "passed, 0 failed" in run.stdout and "nanobind" not in run.stderr
