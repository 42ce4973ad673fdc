"""``poolfuzz run --family sglang``: a config runs through each of SGLang's servers that takes it, and a failure found
through one of them is that server's artifact, replayed on that server."""

from __future__ import annotations

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.pools.config import CONFIGS


def test_a_failure_found_through_one_server_replays_on_that_server(scheduling, api, tmp_path, capsys):
    """``swa-only``'s decode server trips SGLang's own KV page check (docs/bugs/sglang-pure-swa-page-check.md); the
    plain server passes (past its release's judged defects). The run reports the one lane, its artifact names the
    decode server, and ``replay`` rebuilds that server and reproduces it."""
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.scheduler import decode_server
    from poolfuzz.orchestration.artifacts import load

    if reason := decode_server.unsupported_reason(CONFIGS["swa-only"]):
        pytest.skip(reason)
    if not hasattr(compat.invariant_checker(decode_server.SglangDecodeDriver(CONFIGS["swa-only"]).server),
                   "_check_kv_page_invariants"):
        pytest.skip("this release's invariant checker has no KV page check")
    out = tmp_path / "out"
    # the plain server's judged defects on this release passed over, the decode server's not (0.5.16 to 0.5.19:
    # PureSWARadixCache's no-insert branch frees a retracted request's in-window tail twice, fixed in 0.5.20 by
    # sglang#38349; ci/known/sglang-0.5.16-0.5.17.txt and sglang-0.5.18-0.5.22.txt)
    from tests.judged import judged_signatures

    judged = judged_signatures("sglang", api.version, "swa-only", family="sglang:scheduler")
    known = tmp_path / "known.txt"
    known.write_text("".join(f"sglang:scheduler swa-only {signature}\n" for signature in judged))
    assert run_cli(["run", "--family", "sglang", "--config", "swa-only", "--examples", "40", "--seed", "1",
                    "--db", "none", "--out", str(out), "--shrink-seconds", "10", "--known", str(known)]) == 1
    printed = capsys.readouterr().out
    table = {line.split()[0]: line.split()[1] for line in printed.splitlines() if line.startswith("sglang:")
             and "/" in line.split()[0] and len(line.split()) > 2 and not line.split()[1].endswith(":")}
    assert table == {"sglang:scheduler/swa-only": "PASS", "sglang:decode/swa-only": "FAIL"}, printed
    assert "family sglang:hicache skips swa-only" in printed
    (path,) = out.glob("*.json")
    art = load(path)
    assert (art.family, art.config, art.signature) == ("sglang:decode", "swa-only", "InvariantViolation:consumer-map:-")
    assert "sglang-decode" in path.name
    assert run_cli(["replay", str(path)]) == 1  # it reproduces
    replayed = capsys.readouterr().out
    assert "family sglang:decode, config swa-only" in replayed and "KV page use-after-free" in replayed


def test_bench_measures_the_sglang_batch_step_rate(scheduling, api):
    """``poolfuzz bench`` prints the rate of SGLang's own scheduler, a batch step each, where SGLang is installed
    (issue 31); the pools path's rate went with that path."""
    from poolfuzz.orchestration import bench

    figures = bench.engine_steps("cpu", examples=10, reps=1)  # a scheduled machine's first examples run no step
    assert figures["steps_per_second_sglang_scheduler"] > 0, figures
    assert figures["steps_per_second_sglang_scheduler_runs"] == [figures["steps_per_second_sglang_scheduler"]]
    assert "steps_per_second_sglang_pools" not in figures
    assert figures["sglang_version"] == api.version
