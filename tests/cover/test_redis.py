"""``--db redis://``: several machines fuzz one campaign through a shared Redis example database.

The test starts its own ``redis-server`` on 127.0.0.1 with a free port and stops it afterwards.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.harness.machine import machine_for
from poolfuzz.orchestration.runner import database_key, run_machine
from poolfuzz.pools.config import CONFIGS

FAULT = "swa-ignores-mamba-backup"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(workdir):
    """A redis-server on a free loopback port: (process, url); skips the test where it cannot start."""
    pytest.importorskip("redis", reason="the redis extra is not installed: pip install -e '.[redis]'")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); the Redis path is untested here")
    import redis

    port = _free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.skip(f"redis-server did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def doomed_redis(tmp_path):
    """A redis-server of this test's own, which the test kills mid-run."""
    proc, url = _start_redis(tmp_path)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            _stop(proc)


def _kill_redis_on(monkeypatch, proc, event_type):
    """Kill the server (SIGKILL, as a crash would) when the run's first ``event_type`` event arrives:
    mid-run, at a point fixed by the run's own progress rather than by the clock."""
    from poolfuzz.orchestration import session

    handle = session.Display.handle

    def handle_and_kill(self, ev):
        if ev["type"] == event_type and proc.poll() is None:
            proc.kill()
            proc.wait()
        return handle(self, ev)

    monkeypatch.setattr(session.Display, "handle", handle_and_kill)


def test_redis_dying_mid_run_is_not_a_failure(doomed_redis, tmp_path, monkeypatch, capsys):
    """A clean config while the database goes away: one warning, the run goes on, exit 0, no artifact."""
    proc, url = doomed_redis
    _kill_redis_on(monkeypatch, proc, "progress")
    out = tmp_path / "failures"
    code = run_cli(["run", "--config", "dense", "--device", "cpu", "--examples", "30", "--seed", "3",
                    "--db", url, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert not out.exists()
    assert "ConnectionError" not in captured.out and "FAIL" not in captured.out
    warnings = [line for line in captured.err.splitlines() if "unreachable" in line]
    assert len(warnings) == 1 and f"example database {url} unreachable" in warnings[0]
    assert "continuing without it" in warnings[0]


def test_redis_dying_while_shrinking_keeps_the_real_failure(doomed_redis, tmp_path, monkeypatch, capsys):
    """The failure is found, Redis dies as shrinking starts: the report is still the pool bug, shrunk."""
    from poolfuzz.orchestration.artifacts import load

    proc, url = doomed_redis
    _kill_redis_on(monkeypatch, proc, "failure")
    out = tmp_path / "failures"
    code = run_cli(["run", "--config", "swa-ssm", "--faults", FAULT, "--device", "cpu", "--examples", "300",
                    "--seed", "9", "--db", url, "--out", str(out), "--shrink-seconds", "2"])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    assert "FAIL StateLost" in captured.out and "ConnectionError" not in captured.out
    (artifact,) = out.glob("*.json")
    art = load(artifact)
    assert art.error_type == "StateLost" and art.status in ("shrunk", "shrink-limit")
    assert "unreachable" in captured.err and "Traceback" not in captured.err


def test_two_machines_share_one_campaign_through_redis(redis_url, tmp_path, capsys):
    """Machine A finds the failure and files it in Redis; machine B, with its own connection, replays it first."""
    from hypothesis.extra.redis import RedisExampleDatabase
    import redis

    out = tmp_path / "a"
    assert run_cli(["run", "--config", "swa-ssm", "--faults", FAULT, "--device", "cpu", "--examples", "300",
                    "--seed", "9", "--db", redis_url, "--out", str(out), "--shrink-seconds", "0.5"]) == 1
    assert f"database {redis_url}" in capsys.readouterr().out
    database = RedisExampleDatabase(redis.Redis.from_url(redis_url))
    key = database_key(machine_for("swa-ssm", faults=[FAULT]))
    assert list(database.fetch(key))

    # machine B: its own connection to the shared server, nothing else in common with A
    other = RedisExampleDatabase(redis.Redis.from_url(redis_url))
    result = run_machine(CONFIGS["swa-ssm"], faults=[FAULT], max_examples=20, seed=4242, database=other,
                         shrink_limit=0.2)
    assert result.first_failure_examples == 1, "the second machine did not replay the failure from Redis first"


def test_unreachable_redis_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    pytest.importorskip("redis", reason="the redis extra is not installed: pip install -e '.[redis]'")
    monkeypatch.chdir(tmp_path)
    url = f"redis://127.0.0.1:{_free_port()}"  # nothing listens there
    assert run_cli(["run", "--examples", "1", "--db", url]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"cannot reach Redis at {url}" in err and "start redis-server" in err
    assert os.listdir(tmp_path) == []


def test_missing_redis_extra_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis -> ImportError
    assert run_cli(["run", "--examples", "1", "--db", "redis://127.0.0.1:6379"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs the optional redis extra" in err and "pip install 'poolfuzz[redis]'" in err
    assert os.listdir(tmp_path) == []


def test_run_machine_accepts_a_redis_database(redis_url):
    """The runner itself takes any Hypothesis database."""
    from hypothesis.extra.redis import RedisExampleDatabase
    import redis

    db = RedisExampleDatabase(redis.Redis.from_url(redis_url))
    assert run_machine(CONFIGS["dense"], max_examples=2, seed=1, database=db).passed


def test_a_backend_error_warns_once_then_the_database_is_empty_and_drops_writes():
    """Every call Hypothesis makes (save, fetch, delete, move) is covered, whatever the backend."""
    import io

    from hypothesis.database import InMemoryExampleDatabase

    from poolfuzz.orchestration.database import TolerantDatabase

    class Flaky(InMemoryExampleDatabase):
        broken = False

        def _maybe(self):
            if self.broken:
                raise OSError(5, "Input/output error")

        def save(self, key, value):
            self._maybe()
            super().save(key, value)

        def fetch(self, key):
            self._maybe()
            yield from super().fetch(key)

    backend, stream = Flaky(), io.StringIO()
    db = TolerantDatabase(backend, "/mnt/gone", stream=stream)
    db.save(b"k", b"v")
    assert list(db.fetch(b"k")) == [b"v"]
    backend.broken = True
    assert list(db.fetch(b"k")) == []
    db.save(b"k", b"w")
    db.delete(b"k", b"v")
    db.move(b"k", b"j", b"v")
    backend.broken = False  # it came back: the run already went on without it
    assert list(db.fetch(b"k")) == []
    assert stream.getvalue().count("\n") == 1
    assert "example database /mnt/gone unusable (OSError: [Errno 5] Input/output error)" in stream.getvalue()
