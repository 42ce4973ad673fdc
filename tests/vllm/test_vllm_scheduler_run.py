"""``poolfuzz run --family vllm``: vLLM's own Scheduler under the run machinery (issue 30, item 1/5).

Budgets, the summary, exit codes, shrinking, the artifact and its replay, as for any family; the program is
scheduler steps (``scheduler.add_request`` / ``scheduler.schedule`` / ``scheduler.abort``).
"""

from __future__ import annotations

import json
import re

import pytest

from poolfuzz.cli import run_cli
from tests.engine_fuzz import assert_api_changed, run_on_changed_engine
from tests.vllm.judged import known_file

FAMILY = "vllm"


def _run(tmp_path, config: str, examples: int, *extra: str) -> int:
    return run_cli(["run", "--family", FAMILY, "--config", config, "--examples", str(examples), "--seed", "1",
                    "--db", "none", "--device", "cpu", "--out", str(tmp_path / "out"), "--shrink-seconds", "30",
                    *extra])


def _known(api) -> list[str]:
    """``--known`` with the installed release's judged defects (``ci/known/vllm-VERSION.txt``), where it has any:
    a config that is clean of new bugs may still show a real defect of that release (0.16.0's and 0.23.0's
    priority deadlock with async KV loads on dense-ps4), which these tests are not about."""
    path = known_file(api.version)
    return ["--known", str(path)] if path.exists() else []


def _artifacts(tmp_path) -> list:
    return sorted((tmp_path / "out").glob("*.json"))


def test_a_clean_config_passes_through_the_scheduler(scheduling, api, tmp_path, capsys):
    assert _run(tmp_path, "dense-ps4", 15, *_known(api)) == 0
    text = capsys.readouterr().out
    assert re.search(r"dense-ps4\s+PASS\s+15\s", text), text
    assert _artifacts(tmp_path) == []
    # vLLM's manager and block pool run over KV cache groups the adapter lays out: the run says so
    assert ("who built the pools the examples ran on: the adapter's wiring 15\n  dense-ps4: 15 of 15 on the adapter's "
            "wiring, most often: vLLM's KVCacheManager over the KV cache groups the adapter lays out") in text, text


def test_a_planted_double_allocation_is_shrunk_reported_and_replayed(scheduling, api, tmp_path, capsys,
                                                                    double_allocation):
    """A block pool that hands out a block a running request still fills: the run fails (exit 1) with the
    shrunk scheduler program in an artifact, which ``poolfuzz replay`` reproduces (exit 1)."""
    assert _run(tmp_path, "dense-ps4", 30, *_known(api)) == 1
    text = capsys.readouterr().out
    assert re.search(r"dense-ps4\s+FAIL", text), text
    paths = _artifacts(tmp_path)  # the run goes on past a failure: one artifact per distinct signature
    assert paths
    for path in paths:
        art = json.loads(path.read_text())
        assert art["family"] == FAMILY and art["status"] == "shrunk"
        ops = [s["op"] for s in art["program"]]
        assert ops and set(ops) <= {"scheduler.add_request", "scheduler.schedule", "scheduler.abort"}, ops
        assert "state = ScheduledMachine()" in art["hypothesis_program"]
        assert art["pools"]["built_by"] == "adapter", art["pools"]
    # shrunk: a request or two and their steps. Only the shortest report is held to it: where the release's own
    # checks also catch the planted block (0.23.0: the cache_blocks assert in allocate_slots, at admission and
    # while draining) the run has up to five signatures, and some of their shrinks stop at 15-36 steps. The one
    # replayed is the shortest seen in a step (a drain's failure replays as the teardown's, not "at step").
    stepped = [p for p in paths if not json.loads(p.read_text())["in_teardown"]]
    assert stepped, [json.loads(p.read_text())["signature"] for p in paths]
    path = min(stepped, key=lambda p: len(json.loads(p.read_text())["program"]))
    assert len(json.loads(path.read_text())["program"]) <= 8, path.read_text()
    art = json.loads(path.read_text())
    if art["error_type"] == "StateLost":  # the worker saw it (0.23.0: vLLM's own cache_full_blocks assert first)
        assert re.search(r"req \d+ step \d+: full\.k layer \d+ position \d+: block \d+ slot \d+ holds (req \d+'s|"
                         r"the KV of a draft token req \d+)", art["failure"]), art["failure"]
    assert run_cli(["replay", str(path), "--device", "cpu"]) == 1
    replayed = capsys.readouterr().out
    assert "REPRODUCED at step" in replayed, replayed
    if art["error_type"] == "StateLost":  # (replay's report calls a crash, vLLM's own assert, "different")
        assert "the same failure as recorded" in replayed, replayed
    # emit-test writes the program as a pytest module that fails while the bug is planted
    module = tmp_path / "test_regression_x.py"
    assert run_cli(["emit-test", str(path), "-o", str(module)]) == 0
    source = module.read_text()
    assert ("machine = scheduled_machine(get_config(CONFIG), driver_factory=lambda c: factory(c, "
            "backup_mode=BACKUP_MODE))()") in source
    assert "BACKUP_MODE = 'cpu_tensor'" in source
    assert "machine.schedule(" in source and "machine.teardown()" in source
    namespace = {"__name__": "emitted"}
    exec(compile(source, str(module), "exec"), namespace)
    [test] = [f for name, f in namespace.items() if name.startswith("test_")]
    with pytest.raises(AssertionError):  # StateLost, or vLLM's own assert on the doubled block
        test()


ALIGN = "hybrid-extra-buffer-ps4"  # vllm-project/vllm#33706's config (tests/vllm/test_vllm_scheduling.py)


@pytest.mark.anchored
def test_the_33706_config_fails_before_0_17_and_passes_after(scheduling, api, tmp_path, capsys):
    if "align" not in api.mamba_cache_modes:
        pytest.skip(f"vLLM {api.version} has no mamba cache mode align")
    fixed = tuple(int(x) for x in api.version.split(".")[:2]) >= (0, 17)
    code = _run(tmp_path, ALIGN, 100)
    text = capsys.readouterr().out
    if fixed:
        # vllm#46892 (open at 0.34.0): the store's tokens past a request's local hit need two mamba state blocks
        # where the scheduler's admission counts one, so near capacity the allocation runs the pool dry; through
        # the real scheduler with the store's connector attached it is the one failure a fixed release may show.
        for path in _artifacts(tmp_path):
            assert "Cannot get 1 free blocks from the pool" in path.read_text(), text
        assert code == (1 if _artifacts(tmp_path) else 0), text
        return
    assert code == 1, text
    assert re.search(r"StateLost: req \d+ step \d+: mamba\.state layer \d+ position \d+: block \d+ slot \d+ holds ",
                     text), text
    paths = _artifacts(tmp_path)  # one per signature: the defect seen in a step, and while the server drains
    assert paths
    for path in paths:
        assert json.loads(path.read_text())["signature"] in ("StateLost:contents:mamba@schedule",
                                                              "StateLost:contents:mamba@teardown")
    assert run_cli(["replay", str(paths[0]), "--device", "cpu"]) == 1


def test_a_config_the_scheduler_path_does_not_drive_is_declined(scheduling, tmp_path, capsys):
    assert _run(tmp_path, "mla", 5) == 2
    assert re.search(r"family 'vllm' does not support config 'mla': .*MHA", capsys.readouterr().err)


def test_a_release_without_the_scheduler_is_api_changed(scheduling, api, tmp_path):
    """A Scheduler that no longer takes the KV cache config: refused before fuzzing, exit 2, no artifact."""
    run = run_on_changed_engine(["from vllm.v1.core.sched.scheduler import Scheduler",
                                 "Scheduler.__init__ = lambda self, vllm_config, structured_output_manager: None"],
                                family=FAMILY, config="dense", out=tmp_path / "out", examples=5)
    assert_api_changed(run, f"API CHANGED: vllm {api.version}: vllm.v1.core.sched.scheduler:Scheduler: expected a "
                            "callable taking vllm_config, kv_cache_config, structured_output_manager", tmp_path)


def test_bench_measures_both_vllm_paths_in_one_run(scheduling, api):
    """``poolfuzz bench`` prints the scheduler-driven step rate beside the direct-manager one (issue 30)."""
    from poolfuzz.orchestration import bench

    figures = bench.engine_steps("cpu", examples=5, reps=1)
    for key in ("steps_per_second_vllm_manager", "steps_per_second_vllm_scheduler"):
        assert figures[key] > 0 and figures[f"{key}_runs"] == [figures[key]], figures
    assert figures["vllm_version"] == api.version


def test_drawn_configs_are_refused_with_the_family_that_takes_them(scheduling, tmp_path, capsys):
    assert _run(tmp_path, "random", 5) == 2
    err = capsys.readouterr().err
    assert "family 'vllm' drives the engine's own scheduler over named configs only; drop --config random" in err
    assert "use --family vllm:manager, which takes drawn configs" in err
