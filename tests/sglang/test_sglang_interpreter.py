"""Releases whose paged allocator only launches Triton kernels run their paged configs on the CPU, in
Triton's interpreter, where the real triton wheel is installed and no GPU is visible."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.request import ReqKv


@pytest.fixture
def kernel_only(api):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: kernels compile, nothing is interpreted")
    if not api.paged_kernels:
        pytest.skip(f"sglang {api.version}'s paged allocator launches no Triton kernel here "
                    f"(triton: {api.shims.get('triton')})")
    return api


def test_kernels_are_interpreted_and_every_paged_config_is_supported(kernel_only):
    from poolfuzz.adapters.sglang import describe, unsupported_reason

    assert kernel_only.kernels_interpreted and describe()["kernels_interpreted"]
    assert {"alloc_extend_kernel", "alloc_decode_kernel"} & set(kernel_only.paged_kernels)
    # Every paged config of the shapes every release builds (MHA; MLA/DSA/scaled/extra-buffer pools and KV
    # quant methods are declined for reasons of their own, tested in test_sglang_storage.py / _quant.py).
    paged = {name: c for name, c in CONFIGS.items() if c.page_size > 1 and c.attention == "mha"
             and not c.kv_scale_block and not c.mamba_track_slots and not c.spec_draft_tokens and not c.kv_quant}
    assert len(paged) >= 4
    reasons = {name: unsupported_reason(c) for name, c in paged.items()}
    # none declined for the interpreter; a model with recurrent state may be refused by the release's own server
    # validation (0.5.23: "no_buffer only supports page_size=1"), which is SGLang's answer, not the kernels'
    refused = {name: why for name, why in reasons.items() if why is not None}
    assert all(paged[name].has_mamba and why.startswith("SGLang refuses the server") for name, why in refused.items()), \
        refused
    assert sum(1 for name, c in paged.items() if not c.has_mamba and reasons[name] is None) >= 2


def test_interpreted_kernels_hand_out_whole_pages_and_a_full_pool_is_refused(kernel_only):
    from poolfuzz.adapters.sglang import build_family

    fam = build_family(CONFIGS["dense-ps4"])
    ps = fam.config.page_size
    req = ReqKv(rid=1, seqlen=7)
    fam.protocol.admit(req, fam)
    slots = fam.protocol.extend(req, fam, 6).tolist()  # alloc_extend_kernel, interpreted
    assert len(slots) == 6 and slots[0] % ps == 0 and slots == list(range(slots[0], slots[0] + 6))
    slots += fam.protocol.extend(req, fam, 7).tolist()  # alloc_decode_kernel: the same page goes on
    assert slots[6] == slots[5] + 1
    other = ReqKv(rid=2, seqlen=fam.config.full_tokens + ps)
    fam.protocol.admit(other, fam)
    before = fam.free_lists()["full"].available_size()
    with pytest.raises(PoolExhausted) as info:  # more pages than are free: refused, nothing taken
        fam.protocol.extend(other, fam, fam.config.full_tokens)
    assert info.value.space == "full" and fam.free_lists()["full"].available_size() == before


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
