"""The installed vLLM with a piece of its API taken away or reshaped: "API CHANGED", exit 2, no artifact.

Each case runs in a fresh interpreter (the family probes the release once per process): the fake
change is made to vLLM's own classes before poolfuzz loads them, as a new release would make it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.engine_fuzz import assert_api_changed, run_on_changed_engine

CHANGES = {
    # A method the family needs, gone: refused before fuzzing, by the same check doctor runs.
    "removed": ("del KVCacheManager.get_block_ids",
                "API CHANGED: vllm {v}: vllm.v1.core.kv_cache_manager:KVCacheManager.get_block_ids: expected present, "
                "found no such attribute"),
    # Its answer reshaped (a dict per group instead of a tuple of lists): found on the first block table read.
    "reshaped": ("_ids = KVCacheManager.get_block_ids\n"
                 "KVCacheManager.get_block_ids = lambda self, rid: dict(enumerate(_ids(self, rid)))",
                 "API CHANGED: vllm {v}: KVCacheManager.get_block_ids: expected one list of block ids per KV cache "
                 "group (1), found a dict of 1"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_engine_api_change_is_not_a_finding(api, change, tmp_path):
    edit, words = CHANGES[change]
    run = run_on_changed_engine(["from vllm.v1.core.kv_cache_manager import KVCacheManager", edit], family="vllm:manager",
                                config="dense", out=tmp_path / "out", examples=5)
    assert_api_changed(run, words.format(v=api.version), tmp_path)


def test_doctor_passes_on_this_release(api):
    run = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "doctor", "--family", "vllm:manager"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"engine: vllm {api.version}" in run.stdout
    assert "verdict: OK" in run.stdout and " absent   needed" not in run.stdout
