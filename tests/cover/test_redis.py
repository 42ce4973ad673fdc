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


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    pytest.importorskip("redis", reason="the redis extra is not installed: pip install -e '.[redis]'")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); the Redis path is untested here")
    import redis

    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
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
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
