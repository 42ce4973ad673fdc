"""``poolfuzz emit-test``: a readable standalone pytest module that fails with the bug and passes without it."""

import importlib.util
import subprocess
import sys

import pytest

from poolfuzz.orchestration.artifacts import from_program, write_atomic
from poolfuzz.cli import run_cli
from poolfuzz.harness.failures import StateLost

FAULT = "swa-ignores-mamba-backup"
PROGRAM = [
    {"op": "admit", "args": {"prompt_len": 2}},
    {"op": "prefill", "args": {"rid": 1, "chunk": 2}},
    {"op": "decode", "args": {"rids": [1]}},
    {"op": "retract", "args": {"rid": 1}},
    {"op": "resume", "args": {"node": "prefill"}},
]


@pytest.fixture
def emitted(tmp_path):
    artifact = write_atomic(tmp_path / "found.json", from_program("swa-ssm", PROGRAM, faults=[FAULT]))
    path = tmp_path / "test_regression_swa_ssm.py"
    assert run_cli(["emit-test", str(artifact), "-o", str(path)]) == 0
    return path


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_emitted_module_is_plain_readable_calls(emitted):
    source = emitted.read_text()
    assert "engine.admit(prompt_len=2)" in source
    assert "engine.decode(rids=[1])" in source
    assert "engine.resume(node='prefill')" in source
    assert sum(line.strip().startswith("engine.check()") for line in source.splitlines()) == len(PROGRAM)
    assert "failed here: StateLost: req 1 resumed" in source
    assert "engine.sweep()" in source and "engine.drain()" in source
    assert f"FAULTS = [{FAULT!r}]" in source
    assert "hypothesis" not in source.split('"""', 2)[2]  # no Hypothesis needed to run it


def test_fails_with_the_bug_and_passes_once_fixed(emitted):
    """Against the faulty family it raises the recorded StateLost; against the correct one it passes."""
    module = _load(emitted)
    test = next(getattr(module, n) for n in dir(module) if n.startswith("test_"))
    with pytest.raises(StateLost, match=r"req 1 resumed; component mamba\."):
        test()
    module.FAULTS = []  # the fixed family
    test()


def test_standalone_under_pytest(emitted, tmp_path):
    """Run by a plain pytest outside this repository: one copy with the fault fails, one without passes."""
    fixed = tmp_path / "test_regression_fixed.py"
    fixed.write_text(emitted.read_text().replace(f"FAULTS = [{FAULT!r}]", "FAULTS = []"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(emitted), str(fixed)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "StateLost" in proc.stdout


@pytest.mark.parametrize("target, problem", [
    ("missing-dir/test_x.py", "does not exist; create it first"),
    ("test_x.txt", "must name a .py file"),
    (".", "is a directory"),
])
def test_bad_output_path_is_one_line_exit_2(target, problem, tmp_path, capsys, monkeypatch):
    artifact = write_atomic(tmp_path / "found.json", from_program("swa-ssm", PROGRAM, faults=[FAULT]))
    monkeypatch.chdir(tmp_path)
    assert run_cli(["emit-test", str(artifact), "-o", target]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and problem in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["found.json"]
