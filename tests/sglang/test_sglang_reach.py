"""``poolfuzz run --family sglang[:scheduler] --coverage DIR``: the reach over SGLang's own code, measured in the worker."""

import json

import pytest

from poolfuzz.cli import run_cli

pytest.importorskip("coverage", reason="coverage.py is a dependency of poolfuzz (ci/sglang-install.sh installs it)")


def test_reach_covers_sglangs_memory_code_and_the_scheduler(api, tmp_path, capsys):
    from poolfuzz.adapters.sglang import build_scheduler_driver

    reach = tmp_path / "reach"
    code = run_cli(["run", "--family", "sglang:scheduler", "--config", "hybrid-linear", "--examples", "4", "--seed", "1",
                    "--db", "none", "--out", str(tmp_path / "out"), "--coverage", str(reach)])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # the verdict is the release's; the reach is measured either way
    files = json.loads((reach / "reach.json").read_text())["files"]
    # Only what the family declares: SGLang's mem_cache tree and the scheduler's own files.
    assert all(name.startswith(build_scheduler_driver.engine_code) for name in files), sorted(files)
    pool = files["sglang/srt/mem_cache/memory_pool.py"]
    assert 0 < pool["executed"] < pool["statements"] and 0 < pool["taken"] < pool["branches"]
    batch = files["sglang/srt/managers/schedule_batch.py"]
    assert 0 < batch["executed"] < batch["statements"]
    # Files of the tree that a run never imports are reported at 0%, not left out.
    assert any(f["executed"] == 0 for f in files.values())
    assert "sglang/srt/mem_cache/memory_pool.py" in out


def test_the_suites_reach_is_every_servers_code_in_one_table(api, tmp_path, capsys):
    """``--family sglang`` measures what each of its servers declares, together: the scheduler's batch and policy
    code, the decode server's queues and the HiCache server's controller, beside the pools."""
    reach = tmp_path / "reach"
    code = run_cli(["run", "--family", "sglang", "--config", "dense", "--examples", "2", "--seed", "1",
                    "--db", "none", "--out", str(tmp_path / "out"), "--coverage", str(reach)])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    files = json.loads((reach / "reach.json").read_text())["files"]
    for name in ("sglang/srt/managers/schedule_policy.py", "sglang/srt/disaggregation/decode.py",
                 "sglang/srt/managers/cache_controller.py", "sglang/srt/mem_cache/memory_pool.py"):
        assert files[name]["executed"] > 0, name
    assert "sglang:scheduler/dense" in out and "sglang:decode/dense" in out and "sglang:hicache/dense" in out
    # every server of the suite runs dense on the pools SGLang's own configurator builds for its flags
    pools = next(line for line in out.splitlines() if line.startswith("who built the pools"))
    assert pools.startswith("who built the pools the examples ran on: the engine's own code "), pools
    assert "the adapter's wiring" not in pools, pools
