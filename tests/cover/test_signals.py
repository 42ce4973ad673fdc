"""Stopping a run: SIGTERM is Ctrl-C (summary, artifacts kept, workers stopped), and no worker outlives its parent."""

import os
import signal
import subprocess
import sys
import time

import pytest

# Clean configs and a budget far beyond what the test waits for: the run is always stopped by a signal.
LONG_RUN = ["run", "--config", "dense", "swa", "--device", "cpu", "--examples", "100000", "--seed", "1",
            "--db", "none", "--steps", "10"]


def _children(pid: int) -> set[int]:
    out = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.update(int(c) for c in fh.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


def _start(tmp_path, workers: int, **popen):
    argv = [sys.executable, "-m", "poolfuzz.cli", *LONG_RUN, "--workers", str(workers), "--out", str(tmp_path / "out")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, **popen)


def _read_until(proc, needle: str, count: int = 1) -> str:
    """Lines of the run's output up to the ``count``-th containing ``needle`` (the run's own progress,
    not the clock, says when to act)."""
    seen, text = 0, ""
    while seen < count:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            pytest.fail(f"the run ended ({proc.returncode}) before {count} x {needle!r}:\n{text}")
        text += line
        seen += needle in line
    return text


def _importing_torch(pid: int) -> bool:
    """The worker is past interpreter start-up and loading torch (its import takes seconds)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return "libtorch" in fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids, bound: float = 120.0) -> set[int]:
    """Poll until every pid has exited; returns those still alive at the (generous) bound."""
    end = time.monotonic() + bound
    while time.monotonic() < end:
        left = {p for p in pids if _alive(p)}
        if not left:
            return left
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_behaves_like_ctrl_c(tmp_path, workers):
    proc = _start(tmp_path, workers)
    try:
        head = _read_until(proc, "started on", count=2 if workers > 1 else 1)
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = head + rest
    assert proc.returncode == 143, text
    assert "poolfuzz: 0 passed, 0 failed (interrupted)" in text
    assert "Traceback" not in text
    assert not _wait_gone(kids), "a worker outlived the run"


@pytest.mark.slow
def test_no_worker_outlives_a_killed_parent(tmp_path):
    proc = _start(tmp_path, 2)
    kids = set()
    try:
        _read_until(proc, "started on", count=2)
        kids = _children(proc.pid)
        assert len(kids) >= 2
        proc.kill()  # SIGKILL: no handler runs in the parent
        proc.wait()
        left = _wait_gone(kids)
        assert not left, f"workers {sorted(left)} kept fuzzing after their parent died"
    finally:
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


def test_ctrl_c_at_startup_is_clean_with_more_workers_than_cpus(tmp_path):
    """The terminal sends SIGINT to the whole process group, often while workers still import torch."""
    workers = (os.cpu_count() or 1) + 1
    proc = _start(tmp_path, workers, start_new_session=True)
    try:
        head = _read_until(proc, "poolfuzz run:")
        while len([k for k in _children(proc.pid) if _importing_torch(k)]) < workers and proc.poll() is None:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = head + rest
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "(interrupted)" in text


def test_more_workers_than_cpus_is_warned_about(monkeypatch, capsys):
    from poolfuzz.cli import build_parser
    from poolfuzz.cli.run import plan_from_args

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    plan = plan_from_args(build_parser().parse_args(["run", "--workers", "5", "--device", "cpu", "--db", "none"]))
    assert plan.workers == 5
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "warning: --workers 5 is more than the 2 CPUs" in err
    plan_from_args(build_parser().parse_args(["run", "--workers", "2", "--device", "cpu", "--db", "none"]))
    assert capsys.readouterr().err == ""


def test_a_signal_inside_a_gc_callback_is_resent_not_printed_and_lost():
    """Python prints a KeyboardInterrupt raised in a gc callback as "Exception ignored" with a
    traceback, and drops it: Hypothesis runs one around every example."""
    from poolfuzz.orchestration.stopping import Interrupts

    handler = Interrupts(once=True)
    resent = []
    handler.resend = resent.append

    def gc_callback(phase, info):
        handler(signal.SIGINT, sys._getframe())

    gc_callback("start", {})  # no KeyboardInterrupt here
    assert resent == [signal.SIGINT] and handler.signum is None
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, sys._getframe())
    assert handler.signum == signal.SIGINT
    handler(signal.SIGTERM, sys._getframe())  # once: a worker saving its shrink is not interrupted again


def test_a_caught_interrupt_in_exec_code_does_not_change_the_exit_status(tmp_path):
    """A KeyboardInterrupt caught after escaping string-executed code (a stop signal landing in a
    dataclass's generated method) must not turn ``python -m poolfuzz.cli``'s status into death by SIGINT."""
    (tmp_path / "sitecustomize.py").write_text(
        "import poolfuzz.cli as cli\n"
        "real = cli.main\n"
        "def main(argv=None):\n"
        "    code = real(argv)\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
        "    return code\n"
        "cli.main = main\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "faults"], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()
