"""The installed SGLang with a piece of its API taken away: "API CHANGED", exit 2, no artifact (issue 32).

Each case runs in a fresh interpreter: SGLang is imported behind poolfuzz's CPU shims, the piece is
deleted from SGLang's own module or class, as a new release would drop it, then poolfuzz runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.engine_fuzz import assert_api_changed, run_on_changed_engine

CHANGES = {
    # A class every config needs: refused before fuzzing, by the check doctor runs.
    "needed class": ("import sglang.srt.mem_cache.memory_pool as m\ndel m.MambaPool", "hybrid-linear",
                     "API CHANGED: sglang {v}: sglang.srt.mem_cache.memory_pool:MambaPool: expected present, "
                     "found no such attribute"),
    # A private method the adapter runs unbound (compat.PRIVATE), gone: found where it is first used.
    "private method": ("from sglang.srt.managers.schedule_batch import ScheduleBatch\n"
                       "del ScheduleBatch._swa_eviction_trigger", "swa",
                       "API CHANGED: sglang {v}: sglang.srt.managers.schedule_batch:ScheduleBatch._swa_eviction_trigger: "
                       "expected present (a private name the adapter depends on), found no such attribute"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_engine_api_change_is_not_a_finding(api, change, tmp_path):
    edit, config, words = CHANGES[change]
    if change == "private method":
        from poolfuzz.adapters.sglang.tree.trees import tree_problem
        from poolfuzz.pools.config import CONFIGS

        why = tree_problem(api, CONFIGS[config])
        if why:  # the trigger is read only where a decode evicts SWA through SGLang's tree
            pytest.skip(f"{config} runs without SGLang's tree on {api.version}: {why}")
    shims = ["from poolfuzz.adapters.sglang import shims", "shims.install()"]  # SGLang imports behind them
    run = run_on_changed_engine([*shims, edit], family="sglang:pools", config=config, out=tmp_path / "out")
    assert_api_changed(run, words.format(v=api.version), tmp_path)


def test_doctor_passes_on_this_release(api):
    run = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "doctor", "--family", "sglang"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"engine: sglang {api.version}" in run.stdout and "verdict: OK" in run.stdout
    assert " absent   needed" not in run.stdout and " changed " not in run.stdout
