"""Failure artifacts: versioned JSON written atomically, read back whole, and bad files refused in one line."""

import json
import os
import signal
import tempfile
import time

import pytest
from programs import FAULT_35957, PROGRAM_35957

from poolfuzz.cli import run_cli
from poolfuzz.orchestration import artifacts
from poolfuzz.orchestration.stopping import Interrupts
from poolfuzz.orchestration.artifacts import (
    ArtifactError,
    from_program,
    load,
    write_atomic,
)

FAULT, PROGRAM = FAULT_35957, PROGRAM_35957


@pytest.fixture
def artifact_path(tmp_path):
    return write_atomic(tmp_path / "a.json", from_program("swa-ssm", PROGRAM, faults=[FAULT], seed=7))


def test_artifact_records_config_program_and_structured_divergence(artifact_path):
    """Everything a replay needs, plus the versions it was found with, survives a round trip."""
    raw = json.loads(artifact_path.read_text())
    assert raw["schema"] == "poolfuzz-failure" and raw["version"] == artifacts.VERSION
    assert (raw["config"], raw["device"], raw["faults"], raw["seed"]) == ("swa-ssm", "cpu", [FAULT], 7)
    assert raw["hypothesis_version"] and raw["torch_version"] and raw["poolfuzz_version"]
    assert [(s["op"], s["args"]) for s in raw["program"]] == [(s["op"], s["args"]) for s in PROGRAM]
    d = raw["divergence"]
    assert (d["kind"], d["op"], d["rid"], d["component"], d["layer"]) == ("state-lost", "resume", 1, "mamba.conv0", 0)
    assert d["slot_before"] == 1 and isinstance(d["slot_after"], int)
    assert d["expected"].startswith("req 1") and d["found"]
    art = load(artifact_path)
    assert [s.op for s in art.program] == ["admit", "prefill", "retract", "resume"]
    assert art.program[0].outcome.startswith("Req(1)")
    assert art.failure.startswith("StateLost: req 1 resumed")


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, artifact_path):
    """A write that fails half way leaves the previous artifact intact and no temp file behind."""
    before = artifact_path.read_text()
    art = load(artifact_path)
    art.divergence = {"bad": object()}  # not JSON-serialisable: the write fails
    with pytest.raises(TypeError):
        write_atomic(artifact_path, art)
    assert artifact_path.read_text() == before
    assert sorted(os.listdir(artifact_path.parent)) == ["a.json"]


def test_a_stop_signal_during_a_write_lands_after_the_rename(artifact_path, monkeypatch):
    """SIGTERM just after the temp file is made (seen once in CI under load) used to leave it behind:
    the write holds the stop signals, and the interrupt arrives once the new artifact is in place."""
    art = load(artifact_path)
    art.status = "interrupted" if art.status != "interrupted" else "shrunk"
    real_mkstemp = tempfile.mkstemp

    def signalled_mkstemp(*args, **kwargs):
        made = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # Python bytecode, where an unblocked handler raises
            pass
        return made

    monkeypatch.setattr(artifacts.tempfile, "mkstemp", signalled_mkstemp)
    with Interrupts().installed(), pytest.raises(KeyboardInterrupt):
        write_atomic(artifact_path, art)
    assert load(artifact_path).status == art.status
    assert sorted(os.listdir(artifact_path.parent)) == ["a.json"]


def test_a_run_sweeps_the_temp_files_a_killed_run_left(tmp_path):
    """Only old hidden temp files go: a fresh one may be another run's write in progress, and a file
    that is not a temp file is never touched."""
    old, fresh = tmp_path / ".a.json.x1.tmp", tmp_path / ".b.json.x2.tmp"
    keep = [tmp_path / "a.json", tmp_path / ".notes", tmp_path / "scratch.tmp"]
    for f in (old, fresh, *keep):
        f.write_text("{}")
    long_ago = time.time() - artifacts.STALE_TEMP_SECONDS - 1
    os.utime(old, (long_ago, long_ago))
    os.utime(keep[1], (long_ago, long_ago))
    assert artifacts.sweep_stale_temps(tmp_path) == [old.name]
    assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, *(f.name for f in keep)])
    assert artifacts.sweep_stale_temps(tmp_path / "absent") == []


def _corrupt(path, mutate):
    raw = json.loads(path.read_text())
    mutate(raw)
    path.write_text(json.dumps(raw))


BAD = {
    "truncated": (lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), "truncated JSON"),
    "malformed": (lambda p: p.write_text('{"version": 1,, "config": "swa-ssm"}'), "malformed JSON"),
    "not-an-artifact": (lambda p: p.write_text('{"hello": 1}'), "not a poolfuzz failure artifact"),
    "newer-schema": (lambda p: _corrupt(p, lambda r: r.update(version=99)), "upgrade poolfuzz"),
    "no-version": (lambda p: _corrupt(p, lambda r: r.pop("version")), "no valid schema version"),
    "missing-field": (lambda p: _corrupt(p, lambda r: r.pop("program")), "lacks the field 'program'"),
    "unknown-op": (lambda p: _corrupt(p, lambda r: r["program"].append({"op": "explode", "args": {}})),
                   "unknown operation 'explode'"),
    "bad-args": (lambda p: _corrupt(p, lambda r: r["program"][0].update(args={"size": 3})), "do not fit admit"),
    "unknown-config": (lambda p: _corrupt(p, lambda r: r.update(config="gpt-9")), "names config 'gpt-9'"),
    "unknown-fault": (lambda p: _corrupt(p, lambda r: r.update(faults=["no-such-fault"])),
                      "fault 'no-such-fault'"),
    "missing-file": (lambda p: p.unlink(), "does not exist"),
    "unknown-family": (lambda p: _corrupt(p, lambda r: r.update(family="no-such-family")),
                       "recorded on pool family 'no-such-family', which does not load here"),
}


@pytest.mark.parametrize("command", ["replay", "emit-test"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_artifact_is_one_line_exit_2_and_nothing_written(case, command, artifact_path, tmp_path, capsys):
    """Each problem is named in one line with its fix; no traceback, no output file."""
    spoil, expected = BAD[case]
    spoil(artifact_path)
    out_file = tmp_path / "test_regression.py"
    argv = [command, str(artifact_path)] + (["-o", str(out_file)] if command == "emit-test" else ["--device", "cpu"])
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("poolfuzz: error: ")
    assert expected in err
    assert "Traceback" not in err
    assert not out_file.exists()


def test_artifact_error_is_a_usage_error():
    """The CLI turns it into exit status 2."""
    with pytest.raises(ArtifactError, match="does not exist"):
        load("/nonexistent/x.json")


def test_from_program_refuses_a_program_that_passes():
    """Recording a clean program is a mistake, not an artifact."""
    with pytest.raises(ValueError, match="ran clean"):
        from_program("swa-ssm", PROGRAM)


@pytest.mark.parametrize("old, path", [("vllm", "vllm:manager")])
def test_an_engine_program_recorded_on_a_renamed_family_comes_back_on_its_renamed_path(artifact_path, old, path):
    """``vllm`` drove vLLM's manager with engine operations before it ran vLLM's own scheduler: such a file now loads
    (for replay and emit-test alike) on the path it ran on, says so, and is never written back renamed."""
    _corrupt(artifact_path, lambda r: r.update(family=old, faults=[]))
    art = artifacts.load_checked(artifact_path)[0]
    assert (art.family, art.renamed_from) == (path, old)
    assert f"recorded on family '{old}' when it took engine operations; that path is '{path}' now" in \
        artifacts.renamed_note(art)
    assert "renamed_from" not in art.to_json()
    assert artifacts.renamed_note(load(artifact_path)) == ""  # load alone reads the file as it is


def test_an_engine_program_recorded_on_the_retired_sglang_pools_path_says_what_runs_it_now(artifact_path):
    """``sglang`` drove SGLang's pools with engine operations, a path since retired (``sglang:pools``): such a file is
    refused, naming the servers that run that path now, never run on some other family."""
    _corrupt(artifact_path, lambda r: r.update(family="sglang", faults=[]))
    with pytest.raises(artifacts.ArtifactError, match=r"'sglang:pools', which was retired: its path now runs as "
                                                      r"--family sglang \("):
        artifacts.load_checked(artifact_path)
