"""The scheduler machine's streaming-session rules (harness/scheduled.py), over a recording driver: they fire only
on a driver that keeps sessions, programs holding them validate and replay, and a server without sessions says it
cannot run them."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.records import StepRecord
from poolfuzz.harness.scheduled import check_program, replay, scheduled_machine
from poolfuzz.pools.config import CONFIGS

SETTINGS = settings(max_examples=20, stateful_step_count=15, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class RecordingDriver:
    """A server that runs every request to completion at the next step and remembers what it was told."""

    backup_mode = "cpu_tensor"
    flushes = False
    pools_origin = None  # a stand-in server: no pools, so no one built them

    def __init__(self, *, sessions: bool):
        self.streaming_sessions = sessions
        self.calls: list[tuple] = []
        self.running: list[str] = []
        self.next = 1

    def _rid(self) -> str:
        rid, self.next = f"{self.next:06d}", self.next + 1
        return rid

    def add_request(self, **kw):
        rid = self._rid()
        self.calls.append(("add_request", rid))
        self.running.append(rid)
        return rid

    def session_turn(self, *, session, length, max_tokens):
        assert self.streaming_sessions, "a session rule fired on a server without sessions"
        rid = self._rid()
        self.calls.append(("session_turn", session, rid))
        self.running.append(rid)
        return rid

    def close_session(self, session):
        assert self.streaming_sessions, "a session rule fired on a server without sessions"
        self.calls.append(("close_session", session))

    def step(self):
        self.running.clear()

    def abort(self, rid):
        self.running.remove(rid)

    def live(self):
        return list(self.running)

    def propose_drafts(self, tokens):
        pass

    def state_problem(self):
        return None

    def drain(self):
        return None

    def close(self):
        self.calls.append(("close",))


def _run(sessions: bool) -> list[RecordingDriver]:
    drivers: list[RecordingDriver] = []

    def factory(config):
        drivers.append(RecordingDriver(sessions=sessions))
        return drivers[-1]

    run_state_machine_as_test(scheduled_machine(CONFIGS["dense"], driver_factory=factory), settings=SETTINGS)
    return drivers


def test_session_rules_fire_only_on_a_server_with_streaming_sessions():
    with_sessions = [c[0] for d in _run(True) for c in d.calls]
    assert {"session_turn", "close_session", "add_request"} <= set(with_sessions)
    without = [c[0] for d in _run(False) for c in d.calls]  # the driver asserts none fires
    assert "add_request" in without and "session_turn" not in without


def test_a_program_with_session_turns_validates_and_replays():
    program = [StepRecord(op="scheduler.session_turn", args={"session": 1, "length": 3, "max_tokens": 2}, outcome=""),
               StepRecord(op="scheduler.schedule", args={"steps": 1, "drafts": 0}, outcome=""),
               StepRecord(op="scheduler.close_session", args={"session": 1}, outcome="")]
    assert check_program(program) is None
    assert check_program([StepRecord(op="scheduler.close_session", args={"session": -1}, outcome="")]) is not None
    drivers: list[RecordingDriver] = []

    def factory(config):
        drivers.append(RecordingDriver(sessions=True))
        return drivers[-1]

    steps = list(replay(scheduled_machine(CONFIGS["dense"], driver_factory=factory), program))
    assert [s.failure for s in steps] == [None] * 4 and not any(s.cannot_run for s in steps)
    assert drivers[0].calls == [("session_turn", 1, "000001"), ("close_session", 1), ("close",)]
    no_sessions = scheduled_machine(CONFIGS["dense"], driver_factory=lambda c: RecordingDriver(sessions=False))
    first = next(iter(replay(no_sessions, program)))
    assert first.cannot_run == "this server keeps no streaming sessions"


def test_a_server_that_never_finishes_a_request_is_reported_stuck_not_leaking():
    """A driver's drain raising ServerStuck is its own check, so --known can pass over a stuck admission and still
    catch a leak."""
    import pytest

    from poolfuzz.harness.failures import InvariantViolation, signature_of
    from poolfuzz.pools.errors import ServerStuck

    class Stuck(RecordingDriver):
        def drain(self):
            raise ServerStuck("1 request(s) still unfinished after 400 idle steps (req 000001 waiting)")

    machine = scheduled_machine(CONFIGS["dense"], driver_factory=lambda c: Stuck(sessions=False))()
    with pytest.raises(InvariantViolation) as info:
        machine.teardown()
    assert info.value.divergence.check == "stuck"
    assert machine.driver.calls[-1] == ("close",)  # shut down even when its drain failed
    assert signature_of(info.value, in_teardown=True) == "InvariantViolation:stuck:-"
    assert "req 000001 waiting" in str(info.value)


def test_a_request_stuck_behind_a_session_the_server_still_holds_is_its_own_bug():
    """Where the driver can tell what holds the space a stuck request waits for (a streaming session its client closed,
    sglang#31765), that names the signature's space: --known can pass over that cause and still catch another stuck
    admission on the same config."""
    import pytest

    from poolfuzz.harness.failures import InvariantViolation, signature_of
    from poolfuzz.pools.errors import ServerStuck

    class HeldBySession(RecordingDriver):
        def drain(self):
            raise ServerStuck("1 request(s) still unfinished (req 000002 waiting); the server still holds session(s) "
                              "session-0", held="session")

    machine = scheduled_machine(CONFIGS["dense"], driver_factory=lambda c: HeldBySession(sessions=True))()
    with pytest.raises(InvariantViolation) as info:
        machine.teardown()
    assert info.value.divergence.check == "stuck" and info.value.divergence.space == "session"
    assert signature_of(info.value, in_teardown=True) == "InvariantViolation:stuck:session"
    assert "still holds session(s) session-0" in str(info.value)


class _CheckerCrashes(RecordingDriver):
    """A server whose own invariant checker cannot run once a step has run (SGLang 0.5.10's busy check asks a mamba
    radix cache for ``evictable_size``, which raises NotImplementedError)."""

    def state_problem(self):
        if any(call[0] == "add_request" for call in self.calls):
            raise NotImplementedError
        return None


class _Failures:
    """An observer that records the failures the machine tells it of (and reports them all)."""

    def __init__(self):
        self.signatures: list[str] = []

    def example_started(self):
        pass

    def step_ran(self, engine):
        pass

    def example_failed(self, engine, exc, steps, in_teardown):
        from poolfuzz.harness.failures import signature_of

        self.signatures.append(signature_of(exc, in_teardown=in_teardown, op=engine.action))
        return False

    def example_ended(self, engine):
        pass

    def example_declined(self, config, reason):
        pass


def test_a_crash_of_the_servers_own_checker_is_the_examples_recorded_failure():
    """The machine's invariant runs the driver's ``state_problem`` (the engine's own checker) like a step: where the
    checker itself crashes, the observer is told, so the finding's signature and the failure Hypothesis reports are
    the same crash (before, it escaped the observer, and a run reported another example's failure under its text)."""
    import pytest

    observer = _Failures()
    machine = scheduled_machine(CONFIGS["dense"], driver_factory=lambda config: _CheckerCrashes(sessions=False),
                                observer=observer)
    with pytest.raises(NotImplementedError):
        run_state_machine_as_test(machine, settings=SETTINGS)
    assert observer.signatures and set(observer.signatures) == {"Crash:NotImplementedError@schedule"}, \
        observer.signatures


class _StepRaisesOutsideTheGuard(RecordingDriver):
    """A server whose ``live()`` (read by the abort rule's precondition, outside every guard) raises once a request
    is in."""

    def live(self):
        if self.running:
            raise RuntimeError("the server's request list is gone")
        return []


def test_a_failure_raised_outside_the_guards_still_reaches_the_observer():
    """Whatever raises in a step, the observer hears of it at teardown (a failure it never heard of was cut off by
    the run's example budget as if the run had passed)."""
    import pytest

    observer = _Failures()
    machine = scheduled_machine(CONFIGS["dense"], driver_factory=lambda config: _StepRaisesOutsideTheGuard(
        sessions=False), observer=observer)
    with pytest.raises(RuntimeError):
        run_state_machine_as_test(machine, settings=SETTINGS)
    assert observer.signatures and all(s.startswith("Crash:RuntimeError@") for s in observer.signatures), \
        observer.signatures
