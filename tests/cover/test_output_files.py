"""Files poolfuzz writes: never over somebody's file unasked, never a shared name, the umask's mode."""

import os
import stat

import pytest
from programs import FAULT_35957, PROGRAM_35957

from poolfuzz.cli import run_cli
from poolfuzz.orchestration.artifacts import from_program, write_atomic

FAULT, PROGRAM = FAULT_35957, PROGRAM_35957


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return from_program("swa-ssm", PROGRAM, faults=[FAULT])


@pytest.fixture
def umask():
    """Set a umask for the test and restore the old one."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_emit_test_refuses_to_overwrite_without_force(artifact, tmp_path, capsys):
    source = write_atomic(tmp_path / "a.json", artifact)
    target = tmp_path / "test_mine.py"
    target.write_text("# somebody's own tests\n")
    assert run_cli(["emit-test", str(source), "-o", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "exists" in err and "--force" in err
    assert target.read_text() == "# somebody's own tests\n"
    assert run_cli(["emit-test", str(source), "-o", str(target), "--force"]) == 0
    assert "engine.resume(node='prefill')" in target.read_text()


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_artifacts_and_emitted_tests_get_the_mode_the_umask_gives(mask, artifact, tmp_path, umask):
    umask(mask)
    source = write_atomic(tmp_path / "a.json", artifact)
    assert _mode(source) == 0o666 & ~mask
    target = tmp_path / "test_x.py"
    assert run_cli(["emit-test", str(source), "-o", str(target)]) == 0
    assert _mode(target) == 0o666 & ~mask


def test_an_unwritable_output_is_one_line_exit_2(artifact, tmp_path, capsys):
    source = write_atomic(tmp_path / "a.json", artifact)
    # root may write anywhere chmod forbids; /proc refuses new files even to root
    assert run_cli(["emit-test", str(source), "-o", "/proc/test_regression.py"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "cannot write -o '/proc/test_regression.py'" in err and "Traceback" not in err


def test_two_runs_never_share_an_artifact_name(tmp_path, monkeypatch):
    """Two identical runs with one --out, in the same second: each one's check that the name is free
    ran before the other wrote it (``exists`` says False throughout), yet each gets its own file."""
    from pathlib import Path

    from poolfuzz.harness.engine import StepRecord
    from poolfuzz.orchestration import artifacts
    from poolfuzz.orchestration.runner import FailureCandidate
    from poolfuzz.orchestration.session import Lane, Plan, _ArtifactWriter

    monkeypatch.setattr(artifacts, "artifact_name",
                        lambda config, faults, when=None, tag="": f"{config}-20250101-000000{'-' + tag if tag else ''}.json")
    plan = Plan(configs=("swa-ssm",), device="cpu", faults=(FAULT,), seed=1, examples=1, out=str(tmp_path / "out"))
    lane = Lane(index=0, worker=0, config="swa-ssm", seed=1, examples=1)
    candidate = FailureCandidate(steps=(StepRecord(op="admit", args={"prompt_len": 1}, outcome=""),),
                                 error_type="StateLost", message="StateLost: x", divergence={}, in_teardown=False,
                                 backup_mode="cpu_tensor", signature="StateLost:contents:mamba@resume")
    first, second = _ArtifactWriter(plan, lane, "cpu"), _ArtifactWriter(plan, lane, "cpu")
    monkeypatch.setattr(Path, "exists", lambda self: False)
    a, b = first.interim(candidate), second.interim(candidate)
    monkeypatch.undo()
    assert a is not None and b is not None and a != b
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "swa-ssm-20250101-000000-2.json", "swa-ssm-20250101-000000.json"]
    assert artifacts.load(a).failure == artifacts.load(b).failure == "StateLost: x"
