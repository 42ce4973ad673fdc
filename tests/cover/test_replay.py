"""``poolfuzz replay``: step by step, stops at the first divergence, exit 1 if it reproduces, 0 if not."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from poolfuzz.orchestration.artifacts import from_program, load, write_atomic
from poolfuzz.cli import run_cli

FAULT = "swa-ignores-mamba-backup"
PROGRAM = [
    {"op": "admit", "args": {"prompt_len": 1}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
    {"op": "admit", "args": {"prompt_len": 3}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
    {"op": "finish", "args": {"rid": 1}},
]


@pytest.fixture
def artifact_path(tmp_path):
    return write_atomic(tmp_path / "a.json", from_program("swa-ssm", PROGRAM, faults=[FAULT]))


def _edit(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_replay_prints_each_step_and_occupancy_and_stops_at_the_divergence(artifact_path, capsys):
    assert run_cli(["replay", str(artifact_path), "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "admit(prompt_len=1)  -> Req(1) row 1" in out
    assert "retract(rid=1)" in out
    assert "prefill[rows=" in out and "decode[rows=" in out  # occupancy after every step
    assert "REPRODUCED at step 5 (resume)" in out
    assert "finish(rid=1)" not in out  # stopped at the first divergence
    for field in ("request    1 on node prefill", "component  mamba.conv0, layer 0", "slots      before 1",
                  "expected   req 1", "found      "):
        assert field in out
    assert "the same failure as recorded" in out


def test_replay_verbose_shows_live_requests(artifact_path, capsys):
    assert run_cli(["replay", str(artifact_path), "--device", "cpu", "--verbose"]) == 1
    assert "req 1: retracted on prefill" in capsys.readouterr().out


def test_fixed_family_does_not_reproduce(artifact_path, capsys):
    """The same program without the fault runs clean, through the teardown checks: exit 0."""
    _edit(artifact_path, faults=[])
    assert run_cli(["replay", str(artifact_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "did not reproduce: the bug may be fixed" in out
    assert "teardown: sweep, drain" in out


def test_a_step_that_cannot_run_any_more_does_not_reproduce(artifact_path, capsys):
    """If the pools behave differently earlier, a later step may name a request that is gone."""
    raw = json.loads(artifact_path.read_text())
    raw["program"].insert(1, {"op": "finish", "args": {"rid": 7}, "outcome": ""})
    artifact_path.write_text(json.dumps(raw))
    assert run_cli(["replay", str(artifact_path), "--device", "cpu"]) == 0
    assert "did not reproduce: step 2 cannot run here: req 7 does not exist" in capsys.readouterr().out


@pytest.mark.parametrize(("step", "why"), [
    ({"op": "decode_speculative", "args": {"rid": 2, "draft": 1, "accepted": 1}},
     "req 2 is prefilling, the step needs it running"),
    ({"op": "decode_speculative", "args": {"rid": 7, "draft": 1, "accepted": 1}}, "req 7 does not exist"),
])
def test_a_speculative_step_on_a_request_not_running_does_not_reproduce(artifact_path, capsys, step, why):
    """The machine only drafts for running requests; on replay that is checked, not crashed into."""
    raw = json.loads(artifact_path.read_text())
    raw["program"].insert(3, {**step, "outcome": ""})
    artifact_path.write_text(json.dumps(raw))
    assert run_cli(["replay", str(artifact_path), "--device", "cpu"]) == 0
    assert f"did not reproduce: step 4 cannot run here: {why}" in capsys.readouterr().out


def test_queries_are_not_program_operations():
    from poolfuzz.harness.program import operations

    assert "pressure" not in operations() and "decode_speculative" in operations()


def test_artifact_recorded_on_cuda_replays_on_cpu(artifact_path, capsys):
    """The program is engine operations, not device pointers: any device replays it."""
    _edit(artifact_path, device="cuda:3")
    assert run_cli(["replay", str(artifact_path), "--device", "cpu"]) == 1
    assert "recorded on cuda:3" in capsys.readouterr().out


def test_a_plugin_family_is_recorded_and_replayed_on_it(tmp_path, capsys):
    """An artifact found with --family replays (and emits a test) on that family, once the user trusts it."""
    family = "poolfuzz.pools.family:build_family"  # the builtin pools, named as a module:factory plug-in
    path = write_atomic(tmp_path / "f.json", from_program("swa-ssm", PROGRAM, faults=[FAULT], family=family))
    assert load(path).family == family
    assert run_cli(["replay", str(path), "--device", "cpu", "--family", family]) == 1
    assert f"family {family}, config swa-ssm" in capsys.readouterr().out
    test = tmp_path / "test_family.py"
    assert run_cli(["emit-test", str(path), "-o", str(test), "--family", family]) == 0
    assert f"FAMILY = {family!r}" in test.read_text() and "family_factory=resolve_family(FAMILY).factory" in test.read_text()


@pytest.mark.requires_cuda
def test_artifact_recorded_on_cpu_replays_on_cuda(artifact_path, capsys):
    assert run_cli(["replay", str(artifact_path), "--device", "cuda"]) == 1
    assert "replaying on cuda" in capsys.readouterr().out


def test_replay_on_a_missing_gpu_is_a_usage_error(artifact_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --device cuda is valid here")
    assert run_cli(["replay", str(artifact_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no CUDA GPU is visible" in err and "--device cpu" in err


def _wait_for(pattern_dir, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [f for f in os.listdir(pattern_dir) if f.endswith(".json")] if os.path.isdir(pattern_dir) else []
        if found:
            return os.path.join(pattern_dir, found[0])
        if proc.poll() is not None:
            pytest.fail(f"poolfuzz run exited ({proc.returncode}) before writing an artifact:\n"
                        + proc.stdout.read())
        time.sleep(0.05)
    proc.kill()
    pytest.fail("no artifact appeared")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "crash"])
def test_interrupted_run_leaves_its_best_shrink(tmp_path, sig):
    """A failure found, then Ctrl-C, SIGTERM or a kill mid-shrink: the artifact on disk is whole and replays."""
    out = tmp_path / "failures"
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolfuzz.cli", "run", "--config", "swa-ssm", "--faults", FAULT, "--device", "cpu",
         "--examples", "500", "--seed", "9", "--db", "none", "--out", str(out), "--shrink-seconds", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    path = _wait_for(out, proc)
    proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=60)
    art = load(path)
    if sig in (signal.SIGINT, signal.SIGTERM):  # SIGTERM stops a run as Ctrl-C does
        assert proc.returncode == 1, stdout
        assert art.status in ("interrupted", "shrunk")
        assert "1 failed (interrupted)" in stdout or "1 failed" in stdout
        assert "Traceback" not in stdout
        assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    else:  # a kill can land inside a rewrite: its hidden temp file may stay, the artifact itself is whole
        assert art.status in ("shrinking", "shrunk")
    assert art.failure.startswith("StateLost")
    assert run_cli(["replay", path, "--device", "cpu"]) == 1


FULL_POOL_DECODE = [
    *[{"op": "admit", "args": {"prompt_len": 12}} for _ in range(4)],
    *[{"op": "prefill", "args": {"rid": rid, "chunk": 12}} for rid in range(1, 5)],
    {"op": "decode", "args": {"rids": [1]}},  # 48 of 48 tokens held: no slot for request 1
]


@pytest.mark.parametrize(("recorded", "decode_outcome"), [
    # Recorded before retract_on_decode_oom existed: the request waited, and so it does on replay.
    ({"sweep_interval": 8, "poison": True, "resume_after_decode": True}, "-> decoded []"),
    # Recorded now: SGLang's victim is retracted and the decode goes ahead.
    (None, "-> decoded [1]; full exhausted: retract Req(4)"),
])
def test_an_artifact_replays_under_the_options_it_was_recorded_with(tmp_path, capsys, recorded, decode_outcome):
    from poolfuzz.orchestration.artifacts import engine_options

    path = write_atomic(tmp_path / "a.json", from_program("swa-ssm", PROGRAM, faults=[FAULT]))
    _edit(path, config="dense", faults=[], backup_mode="host_pool", program=FULL_POOL_DECODE)
    if recorded is not None:
        _edit(path, engine_options=recorded)
    assert engine_options(load(path), str(path))["retract_on_decode_oom"] is (recorded is None)
    assert run_cli(["replay", str(path), "--device", "cpu"]) == 0
    assert decode_outcome in capsys.readouterr().out
    # A regression test emitted from it pins the same behaviour.
    from poolfuzz.cli.emit import render

    assert f"retract_on_decode_oom={recorded is None}" in render(load(path))


def test_replay_into_a_closed_pipe_keeps_its_verdict_and_prints_no_traceback(artifact_path):
    """``poolfuzz replay FILE | head -1``: the reader is gone before the first line (its end of the
    pipe is closed up front, so the test does not depend on timing)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "replay", str(artifact_path), "--device", "cpu"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 1, proc.stderr  # it reproduces: the verdict is not lost with the output
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("op", "same"), [("retract", True), ("decode", False), (None, False)])
def test_a_crash_is_judged_the_same_by_its_class_and_operation(op, same):
    """A crash carries no divergence of its own: it is the recorded failure when its signature is (the class and
    the operation it came from), even with an empty message (a bare NotImplementedError used to read as different)."""
    import types

    from poolfuzz.cli.replay import _report

    recorded = types.SimpleNamespace(error_type="NotImplementedError", signature="Crash:NotImplementedError@retract",
                                     failure="NotImplementedError: ", divergence={"kind": "exception", "op": "retract"})
    out = []
    _report(out.append, NotImplementedError(), recorded, op=op)
    verdict = out[-1]
    assert verdict == ("the same failure as recorded\n" if same else
                       "a different failure than recorded (NotImplementedError: )\n"), out
