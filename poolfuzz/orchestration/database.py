"""Hypothesis example databases for fuzz sessions: a local directory or a shared Redis.

``poolfuzz run`` saves every failing example under a key that names the machine it fails on
(config, faults, backup mode), the same key a plain ``run_state_machine_as_test`` of that
machine uses, so a later ``pytest`` or ``poolfuzz run`` in the same place replays it first.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from poolfuzz.errors import UsageError

# Hypothesis's own default location, so a plain ``pytest`` (dev profile) in the same folder shares it.
DEFAULT_DB = os.path.join(".hypothesis", "examples")
REDIS_EXTRA = "pip install 'poolfuzz[redis]'"


def check_database(spec: str | None) -> str | None:
    """Validate ``--db`` without writing anything: a path, ``redis://HOST:PORT[/N]`` or ``none``.

    Returns the normalised spec (``None`` for no database). A Redis server is pinged here, so an
    unreachable one is a usage error before any fuzzing starts.
    """
    spec = DEFAULT_DB if spec is None else spec.strip()
    if spec.lower() in ("none", "off", ""):
        return None
    if "://" in spec:
        scheme = urlsplit(spec).scheme
        if scheme not in ("redis", "rediss"):
            raise UsageError(f"--db {spec!r}: unsupported scheme {scheme!r}; "
                             "use a directory path, redis://HOST:PORT, or none")
        _redis_client(spec, ping=True)
        return spec
    if os.path.exists(spec) and not os.path.isdir(spec):
        raise UsageError(f"--db {spec!r} is a file, not a directory; pass a directory for the example "
                         "database (it is created if missing) or redis://HOST:PORT")
    from poolfuzz.orchestration.paths import check_writable_dir

    check_writable_dir(spec, "--db")  # Hypothesis would drop every save into it silently
    return spec


def open_database(spec: str | None) -> ExampleDatabase | None:
    """The database a checked spec names (``None``: no database), wrapped so that its outage is
    an infrastructure warning, never a failure (see :class:`TolerantDatabase`)."""
    if spec is None:
        return None
    if "://" in spec:
        from hypothesis.extra.redis import RedisExampleDatabase

        return TolerantDatabase(RedisExampleDatabase(_redis_client(spec, ping=False)), spec)
    return TolerantDatabase(DirectoryBasedExampleDatabase(spec), spec)


def _backend_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError,)
    try:
        import redis

        errors += (redis.exceptions.RedisError,)
    except ImportError:
        pass
    return errors


class TolerantDatabase(ExampleDatabase):
    """An example database whose backend may go away mid-run (Redis stopped, a disk gone).

    Hypothesis calls the database from inside a test, so a backend error there became the test's
    error: a Redis outage was reported as ``FAIL ConnectionError`` with an artifact, and during
    shrinking it replaced the real failure. Here the first such error prints one warning to
    stderr; from then on the database is empty and drops writes, and the run goes on without it.
    """

    def __init__(self, backend: ExampleDatabase, spec: str, *, stream=None):
        super().__init__()
        self.backend, self.spec, self._stream = backend, spec, stream
        self.down: str | None = None  # why the backend was given up on
        self._errors = _backend_errors()

    def __repr__(self) -> str:
        return f"TolerantDatabase({self.backend!r})"

    def _give_up(self, exc: BaseException) -> None:
        first = self.down is None
        reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__
        self.down = f"{type(exc).__name__}: {reason}"
        if first:
            import sys

            stream = self._stream or sys.stderr
            state = "unreachable" if "://" in self.spec else "unusable"
            stream.write(f"poolfuzz: warning: example database {self.spec} {state} ({self.down}); "
                         "continuing without it: failures found from now on are not saved there\n")
            stream.flush()

    def fetch(self, key: bytes):
        if self.down is not None:
            return
        try:
            values = list(self.backend.fetch(key))  # a generator: its errors come while iterating
        except self._errors as exc:
            self._give_up(exc)
            return
        yield from values

    def save(self, key: bytes, value: bytes) -> None:
        self._call(self.backend.save, key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._call(self.backend.delete, key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._call(self.backend.move, src, dest, value)

    def _call(self, method, *args) -> None:
        if self.down is not None:
            return
        try:
            method(*args)
        except self._errors as exc:
            self._give_up(exc)


def _redis_client(spec: str, *, ping: bool):
    try:
        import redis
    except ImportError:
        raise UsageError(f"--db {spec} needs the optional redis extra, which is not installed; "
                         f"install it with: {REDIS_EXTRA}") from None
    try:
        client = redis.Redis.from_url(spec, socket_connect_timeout=3, socket_timeout=30)
    except ValueError as exc:
        raise UsageError(f"--db {spec!r} is not a valid Redis URL ({exc}); use redis://HOST:PORT") from None
    if ping:
        try:
            client.ping()
        except redis.exceptions.RedisError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(f"cannot reach Redis at {spec} ({reason}); start redis-server there, check the "
                             "host and port, or use a local directory with --db PATH") from None
    return client


class KeepingDatabase(ExampleDatabase):
    """A view of a database that never deletes: what a run passing over known bugs writes through.

    Such a run rejects the examples of a known bug, so Hypothesis, replaying a saved failure that
    now "passes", would delete it: a later run (or a plain pytest) could no longer replay the bug
    first. Saves go through; deletes and moves' deletes are dropped."""

    def __init__(self, backend: ExampleDatabase):
        super().__init__()
        self.backend = backend

    def __repr__(self) -> str:
        return f"KeepingDatabase({self.backend!r})"

    def fetch(self, key: bytes):
        return self.backend.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        self.backend.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        pass

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.backend.save(dest, value)
