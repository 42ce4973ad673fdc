"""The CI workflow files parse, and every command they run exists with the options it is given."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "ci").glob("*.yml"))
yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the workflow files")


def _load(path):
    wf = yaml.safe_load(path.read_text())
    wf["on"] = wf.get("on", wf.pop(True, None))  # YAML 1.1 reads a bare `on` as true
    return wf


def _commands(wf):
    """(job, env, argv) for every command line of every `run:` step."""
    for job_name, job in wf["jobs"].items():
        for step in job["steps"]:
            if "run" not in step:
                continue
            for line in step["run"].splitlines():
                line = re.sub(r"\$\{\{[^}]*\}\}", "X", line)
                line = re.sub(r'"?\$\([^)]*\)"?', "2", line)  # $(nvidia-smi -L | wc -l) -> a count
                if not line.strip():
                    continue
                argv = shlex.split(line)
                env = dict(step.get("env") or {})
                while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
                    key, value = argv.pop(0).split("=", 1)
                    env[key] = value
                yield job_name, env, argv


def test_there_are_a_cpu_and_a_gpu_workflow():
    names = {p.name for p in WORKFLOWS}
    assert {"cpu.yml", "gpu.yml"} <= names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_structure(path):
    wf = _load(path)
    assert wf["name"] and wf["on"] and wf["jobs"]
    for name, job in wf["jobs"].items():
        assert job.get("runs-on"), name
        assert 0 < job.get("timeout-minutes", 0) <= 60, f"{name}: a timeout keeps a hung GPU from blocking CI"
        for step in job["steps"]:
            assert ("run" in step) != ("uses" in step), step
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@v\d+", step["uses"]), f"pin {step['uses']} to a major version"


def test_gpu_workflow_runs_on_self_hosted_gpu_runners_and_keeps_the_database():
    wf = _load(ROOT / "ci" / "gpu.yml")
    for job in wf["jobs"].values():
        assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    nightly = wf["jobs"]["nightly"]
    assert "schedule" in wf["on"]
    uses = [s.get("uses", "") for s in nightly["steps"]]
    assert any(u.startswith("actions/cache/restore@") for u in uses)
    assert any(u.startswith("actions/upload-artifact@") for u in uses)
    upload = next(s for s in nightly["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload.get("if") == "always()"
    assert ".hypothesis/examples" in upload["with"]["path"] and "poolfuzz-failures" in upload["with"]["path"]
    runs = [argv for _, _, argv in _commands(wf)]
    run = next(argv for argv in runs if argv[:2] == ["poolfuzz", "run"])
    assert run[run.index("--minutes") + 1] == "30" and "--db" in run and "--out" in run
    tests = next(argv for job, _, argv in _commands(wf) if job == "tests" and "pytest" in argv)
    assert "--device" in tests and tests[tests.index("--device") + 1] == "cuda" and "-n" in tests


def test_cpu_workflow_runs_the_suite_under_the_ci_profile_on_every_core():
    cmds = [(env, argv) for _, env, argv in _commands(_load(ROOT / "ci" / "cpu.yml"))]
    env, argv = next((e, a) for e, a in cmds if "pytest" in a)
    assert env.get("HYPOTHESIS_PROFILE") == "ci"
    assert argv[argv.index("-n") + 1] == "auto"


def test_ci_entry_point_runs_the_suite_under_the_ci_profile():
    """.ci/run must be reproducible from its log even where the runner does not export CI."""
    script = (ROOT / ".ci" / "run").read_text()
    assert 'export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"' in script
    assert script.index("export HYPOTHESIS_PROFILE") < script.index("python -m pytest -n 2")


ALLOWED_TOOLS = {"nvidia-smi", "sudo"}
PYTEST_OPTIONS = {"--device": 1, "-n": 1, "-q": 0, "-x": 0, "-p": 1}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_command_exists(path):
    from hypothesis import settings

    from poolfuzz.cli import build_parser

    parser = build_parser()
    for job, env, argv in _commands(_load(path)):
        where = f"{path.name} job {job}: {shlex.join(argv)}"
        if "HYPOTHESIS_PROFILE" in env:
            settings.get_profile(env["HYPOTHESIS_PROFILE"])  # raises if the profile is not registered
        if argv[0] == "poolfuzz":
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{where}: the poolfuzz CLI rejects these arguments")
        elif argv[:3] == ["python", "-m", "pytest"]:
            rest = argv[3:]
            while rest:
                opt = rest.pop(0)
                assert opt in PYTEST_OPTIONS, f"{where}: unexpected pytest option {opt}"
                values = [rest.pop(0) for _ in range(PYTEST_OPTIONS[opt])]
                if opt == "--device":
                    assert re.fullmatch(r"cpu|cuda(:\d+)?|auto", values[0]), where
        elif argv[:4] == ["python", "-m", "pip", "install"]:
            for extra in re.findall(r"\.\[([\w,-]+)\]", " ".join(argv)):
                pyproject = (ROOT / "pyproject.toml").read_text()
                for name in extra.split(","):
                    assert re.search(rf"^{name}\s*=", pyproject, re.M), f"{where}: no extra {name!r}"
        elif argv[0] == "bash":
            script = ROOT / argv[1]
            assert script.is_file(), f"{where}: {argv[1]} does not exist"
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, f"{where}: syntax error"
        else:
            assert argv[0] in ALLOWED_TOOLS, f"{where}: unknown command {argv[0]!r}"


def test_gpu_check_without_a_gpu_fails_clearly():
    """One line naming the problem and the fix, exit 2, before any check runs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: gpu-check.sh would run its checks")
    proc = subprocess.run(["bash", str(ROOT / "ci" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert proc.stdout == ""
    err = proc.stderr.strip()
    assert "\n" not in err and "no CUDA GPU is visible" in err and "GPU machine" in err
