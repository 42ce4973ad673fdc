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
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_an_engine_api_change_is_not_a_finding(api, change, tmp_path):
    edit, config, words = CHANGES[change]
    shims = ["from poolfuzz.adapters.sglang import shims", "shims.install()"]  # SGLang imports behind them
    run = run_on_changed_engine([*shims, edit], family="sglang:scheduler", config=config, out=tmp_path / "out")
    assert_api_changed(run, words.format(v=api.version), tmp_path)


def test_doctor_passes_on_this_release(api):
    run = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "doctor", "--family", "sglang"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"engine: sglang {api.version}" in run.stdout and "verdict: OK" in run.stdout
    # an optional feature a release lacks is listed as absent or changed (0.5.9 has no --enable-streaming-session)
    assert " absent   needed" not in run.stdout and " changed  needed" not in run.stdout


# A release reshaped under the pools SGLang builds for a config's server (``compat/drift.py``): the run says API CHANGED
# where, until stop 61, the family fell back to the adapter's own wiring and every lane passed untested (0.5.16, 0.5.17,
# 0.5.19 to 0.5.21). Each edit stands for one of those drifts: (edit, what the release must have, words).
BUILD_DRIFTS = {
    # a keyword renamed (0.5.17's configure_kv_cache_dtype took no speculative_draft_kv_cache_dtype): the adapter's call
    # does not bind, in its own frame
    "renamed keyword": (
        "from sglang.srt.configs.model_config import ModelConfig as M\n"
        "f = M.from_server_args\n"
        "M.from_server_args = staticmethod(lambda server_args, model_dir=None, is_draft_model=False: "
        "f(server_args, model_path=model_dir, is_draft_model=is_draft_model))",
        None,
        ("API CHANGED: sglang {v}: the adapter's call at poolfuzz/adapters/sglang/pools/",
         "TypeError: <lambda>() got an unexpected keyword argument 'model_path'")),
    # the runner reads a field its stand-in was not made with (0.5.21's pp_size): on the configurator's runner
    # stand-in from 0.5.16, on the model runner made without its __init__ before
    "stand-in field": (
        "from poolfuzz.adapters.sglang import api\n"
        "api.load()  # SGLang's pools imported as the family imports them (0.5.9's sgl_kernel stand-in among them)\n"
        "from sglang.srt.model_executor.model_runner import ModelRunner as R\n"
        "name = 'init_kv_cache_configurator' if hasattr(R, 'init_kv_cache_configurator') else 'init_memory_pool'\n"
        "f = getattr(R, name)\n"
        "def reads_more(self, *a, **k):\n"
        "    self.a_field_this_release_sets_in_init\n"
        "    return f(self, *a, **k)\n"
        "setattr(R, name, reads_more)",
        None,
        ("what SGLang's ", "reads of the adapter's stand-in ModelRunner",
         "has no attribute 'a_field_this_release_sets_in_init'")),
    # the Scheduler, made without its __init__, is read for a field the release's __init__ now sets (the scheduler
    # path only: its init_chunked_prefill runs on the stand-in at every server build)
    "scheduler field": (
        "from poolfuzz.adapters.sglang.scheduler.scheduling import scheduler_modules\n"
        "S = scheduler_modules().Scheduler  # imported as the scheduler path imports it (0.5.12's sgl_kernel)\n"
        "f = S.init_chunked_prefill\n"
        "def reads_more(self):\n"
        "    self.a_field_this_release_sets_in_init\n"
        "    return f(self)\n"
        "S.init_chunked_prefill = reads_more",
        "sglang:scheduler",
        ("what the sglang scheduler path's build for config 'dense' reads of the adapter's stand-in Scheduler",
         "has no attribute 'a_field_this_release_sets_in_init'")),
    # the same, read by a step of the server (the harness would have reported a Crash found in SGLang, with an artifact)
    "scheduler field in a step": (
        "from poolfuzz.adapters.sglang.scheduler.scheduling import scheduler_modules\n"
        "S = scheduler_modules().Scheduler\n"
        "f = S.get_next_batch_to_run\n"
        "def reads_more(self, *a, **k):\n"
        "    self.a_field_this_release_sets_in_init\n"
        "    return f(self, *a, **k)\n"
        "S.get_next_batch_to_run = reads_more",
        "sglang:scheduler",
        ("API CHANGED: sglang {v}: what the sglang scheduler path's ", "reads of the adapter's stand-in Scheduler",
         "has no attribute 'a_field_this_release_sets_in_init'")),
    # SGLang's platform seam refuses a fact the adapter states (0.5.19 to 0.5.21 refused is_mps and is_sm110)
    "platform fact": (
        "import sglang.srt.runtime_context as rc\n"
        "f = rc.override_platform\n"
        "def override_platform(**facts):\n"
        "    if 'is_cuda' in facts:\n"
        "        raise ValueError(\"unknown platform fact(s): ['is_cuda']\")\n"
        "    return f(**facts)\n"
        "rc.override_platform = override_platform",
        "override_platform",
        ("API CHANGED: sglang {v}: sglang.srt.runtime_context:override_platform: expected to take the platform facts "
         "the adapter states (", "found ValueError: unknown platform fact(s): ['is_cuda']")),
}


@pytest.mark.parametrize("family", ["sglang:scheduler", "sglang:decode"])
@pytest.mark.parametrize("drift", sorted(BUILD_DRIFTS))
def test_a_server_build_the_release_reshaped_is_api_changed_not_the_wiring(api, drift, family, tmp_path):
    from poolfuzz.adapters.sglang.compat import has_private
    from poolfuzz.adapters.sglang.pools import configurator

    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")

    edit, needs, words = BUILD_DRIFTS[drift]
    if needs and needs.startswith("sglang:") and needs != family:
        pytest.skip(f"the edit stands for a drift of {needs} only")
    if needs and not needs.startswith("sglang:") and not has_private(needs):
        pytest.skip(f"sglang {api.version} has no {needs}")
    shims = ["from poolfuzz.adapters.sglang import shims", "shims.install()"]
    run = run_on_changed_engine([*shims, edit], family=family, config="dense", out=tmp_path / "out", examples=5)
    for piece in words:
        assert_api_changed(run, piece.format(v=api.version), tmp_path)
