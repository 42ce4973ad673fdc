"""Runs the state machine for one (config, faults, backup mode) and returns what happened.

Besides Hypothesis's own report, the runner keeps the failure as an engine-level program
(:mod:`poolfuzz.harness.program`): every failing example Hypothesis runs while it shrinks is
offered to ``on_failure`` when it is the smallest so far, so an interrupted or time-limited run
still hands back (and lets the caller write) its best shrink.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from poolfuzz.harness.engine import StepRecord
from poolfuzz.harness.failures import PoolfuzzFailure, divergence_of, message_of
from poolfuzz.harness.machine import machine_for
from poolfuzz.pools.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class RunResult:
    config: str
    faults: tuple[str, ...]
    backup_mode: str
    examples: int
    steps: int
    seconds: float
    failure: str | None  # the shrunk failure's message
    program: str | None  # the shrunk program as runnable Python (see _runnable_program)
    divergence: dict | None
    first_failure_examples: int | None = None  # examples run up to and including the first failing one
    first_failure_seconds: float | None = None
    engine_steps: tuple = ()  # the shrunk failure as engine operations (StepRecord), replayable
    device: str = "cpu"
    seed: int | None = None
    error_type: str | None = None  # the failure's class name (StateLost, ...)
    reproduce_blob: str | None = None  # @reproduce_failure(version, blob) of the reported example
    shrunk: bool = True  # False: shrinking was cut short (time limit or interrupt); best so far
    interrupted: bool = False  # Ctrl-C arrived; a failure, if any, is the best shrink so far
    database_key: str | None = None  # hex key of the machine in the example database
    in_teardown: bool = False  # the failure came from the final sweep / drain, after engine_steps

    @property
    def passed(self) -> bool:
        return self.failure is None


@dataclass(frozen=True, kw_only=True)
class FailureCandidate:
    """A failing example seen while fuzzing or shrinking, as an engine-level program."""

    steps: tuple  # StepRecord, the machine's steps (teardown excluded)
    error_type: str
    message: str
    divergence: dict
    in_teardown: bool  # the failure came from the final sweep / drain
    backup_mode: str  # the retraction path of the family that failed (plug-ins may refuse others)
    reproduce: str | None = None  # @reproduce_failure(...) for this example

    @property
    def size(self) -> tuple[int, int]:
        return (len(self.steps), sum(len(repr(s.args)) for s in self.steps))


class _BudgetSpent(KeyboardInterrupt):
    """Raised from a new example when the time budget or shrink limit is spent; not a failure.

    A KeyboardInterrupt, because that is what Hypothesis lets through untouched: it neither
    saves the example nor replays it."""


@dataclass
class _Tracker:
    started: float
    deadline: float | None
    shrink_limit: float | None
    on_progress: Callable | None
    on_failure: Callable | None
    examples: int = 0
    steps: int = 0
    first_examples: int | None = None
    first_seconds: float | None = None
    best: FailureCandidate | None = None
    last: FailureCandidate | None = None

    def new_example(self) -> None:
        now = time.perf_counter()
        if self.examples and not _is_final():
            if self.first_seconds is None and self.deadline is not None and now >= self.deadline:
                raise _BudgetSpent()
            if (self.first_seconds is not None and self.shrink_limit is not None
                    and now - self.started - self.first_seconds >= self.shrink_limit):
                raise _BudgetSpent()
        self.examples += 1
        if self.on_progress is not None:
            self.on_progress(self.snapshot())

    def snapshot(self) -> dict:
        return {"examples": self.examples, "steps": self.steps, "seconds": time.perf_counter() - self.started,
                "status": "running" if self.first_seconds is None else "shrinking",
                "best": None if self.best is None else len(self.best.steps)}

    def saw_failure(self, candidate: FailureCandidate) -> None:
        if self.first_examples is None:
            self.first_examples = self.examples
            self.first_seconds = time.perf_counter() - self.started
        self.last = candidate
        if self.best is None or candidate.size < self.best.size:
            self.best = candidate
            if self.on_failure is not None:
                self.on_failure(candidate)


def _is_final() -> bool:
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:
        return False


def _reproduction() -> str | None:
    """The @reproduce_failure decorator of the example running now (None where Hypothesis hides it)."""
    try:
        from hypothesis.control import current_build_context
        from hypothesis.core import reproduction_decorator

        return reproduction_decorator(current_build_context().data.choices)
    except Exception:
        return None


def _noting_call(machine, name: str, bound):
    """``bound`` that notes its call on the machine while it runs: an op that raises never records
    itself. The arguments are bound to names only if it does (see ``_pending_step``)."""

    def call(*args, **kwargs):
        machine._pending = (name, args, kwargs)
        result = bound(*args, **kwargs)
        machine._pending = None
        return result

    return call


def _pending_step(engine, pending, exc: BaseException) -> StepRecord:
    """The step that raised, as the record it would have written: named arguments, no outcome."""
    name, args, kwargs = pending
    bound = inspect.signature(getattr(type(engine), name)).bind(engine, *args, **kwargs).arguments
    bound.pop("self")
    return StepRecord(op=name, args=dict(bound), outcome=f"raised {type(exc).__name__}")


def database_key(machine_cls) -> bytes | None:
    """The key a plain ``run_state_machine_as_test(machine_cls)`` files its examples under."""
    try:
        from hypothesis.internal.reflection import function_digest

        return function_digest(get_state_machine_test(machine_cls).hypothesis.inner_test)
    except Exception:  # a Hypothesis without these internals: it picks a key of its own
        return None


def run_machine(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None, max_examples=100,
                steps_per_example=40, seed: int | None = None, database=None,
                time_budget: float | None = None, round_examples: int = 500,
                shrink_limit: float | None = None, on_progress: Callable[[dict], None] | None = None,
                on_failure: Callable[[FailureCandidate], None] | None = None,
                family_factory=None) -> RunResult:
    """Fuzz one configuration; shrink and report the first failure, if any.

    With ``time_budget`` (seconds) it runs rounds of ``round_examples`` examples, each with the
    next seed, until the budget is spent or a failure is found; the budget is checked before each
    example. ``shrink_limit`` (seconds after the first failure) cuts shrinking short and reports the
    best shrink so far. ``seed`` None with no database is derandomized. Ctrl-C returns the result
    so far with ``interrupted`` set. ``on_progress(snapshot)`` is called before every example and
    ``on_failure(candidate)`` whenever a smaller failing example is seen.
    """
    base = machine_for(config, device=device, faults=faults, backup_mode=backup_mode,
                       **({"family_factory": family_factory} if family_factory is not None else {}))
    started = time.perf_counter()
    tracker = _Tracker(started=started, deadline=None if time_budget is None else started + time_budget,
                       shrink_limit=shrink_limit, on_progress=on_progress, on_failure=on_failure)
    from poolfuzz.harness.program import operations

    ops = list(operations())

    class Counted(base):
        def __init__(self):
            tracker.new_example()
            super().__init__()
            self._pending = None
            self._wrap_operations()

        def _wrap_operations(self):
            for name in ops:
                setattr(self.engine, name, _noting_call(self, name, getattr(self.engine, name)))

        def check_invariants(self, *args, **kwargs):  # hypothesis calls this once per step
            tracker.steps += 1
            return super().check_invariants(*args, **kwargs)

        def teardown(self):
            pending_exc = sys.exc_info()[1]
            start = len(self.engine.log)
            raised = None
            try:
                super().teardown()
            except Exception as exc:
                raised = exc
                raise
            finally:
                exc = raised if raised is not None else (pending_exc if self.engine.broken else None)
                if isinstance(exc, Exception):
                    steps = list(self.engine.log[:start])
                    if raised is None and self._pending is not None:  # the failing op never recorded itself
                        steps.append(_pending_step(self.engine, self._pending, exc))
                    tracker.saw_failure(FailureCandidate(
                        steps=tuple(steps), error_type=type(exc).__name__, message=message_of(exc),
                        divergence=divergence_of(exc, self.engine), in_teardown=raised is not None,
                        backup_mode=self.engine.families["prefill"].backup_mode, reproduce=_reproduction()))

    Counted.__name__ = Counted.__qualname__ = "PoolMachine"
    key = database_key(base)
    chosen = settings(
        max_examples=max_examples, stateful_step_count=steps_per_example, deadline=None, database=database,
        derandomize=seed is None and database is None, print_blob=True, report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    if seed is None and database is not None:
        seed = 0
    error = None
    interrupted = False
    rounds = [seed] if time_budget is None else _seeds(seed)
    try:
        for round_seed in rounds:
            if time_budget is not None:
                chosen = settings(chosen, max_examples=round_examples, derandomize=False)
            Counted._hypothesis_internal_use_seed = round_seed
            test = get_state_machine_test(Counted, settings=chosen)
            if key is not None:
                test._hypothesis_internal_database_key = key
            with with_reporter(lambda *_: None):
                test()
            if time_budget is None or time.perf_counter() - started >= time_budget:
                break
    except _BudgetSpent:
        pass
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # the shrunk failure (or a crash in the pools, or a flaky one)
        error = exc

    final = tracker.last if error is not None else tracker.best
    failure = program = blob = divergence = error_type = None
    engine_steps: tuple = ()
    if error is not None:
        failure, error_type = message_of(error), type(error).__name__
        notes = getattr(error, "__notes__", [])
        program = _runnable_program(notes)
        blob = next(iter(re.findall(r"@reproduce_failure\(.*?\)", "\n".join(notes))), None)
        # A crash's divergence is the one seen with its engine; a poolfuzz failure carries its own.
        divergence = (final.divergence if final is not None and not isinstance(error, PoolfuzzFailure)
                      else divergence_of(error))
    elif final is not None:  # stopped or interrupted while shrinking: the best so far
        failure, error_type, divergence = final.message, final.error_type, final.divergence
    if final is not None:
        engine_steps = final.steps
        blob = blob or final.reproduce
    return RunResult(config=config.name, faults=tuple(faults),
                     backup_mode=final.backup_mode if final is not None else resolved_backup_mode(
                         config, faults, backup_mode, family_factory),
                     examples=tracker.examples, steps=tracker.steps,
                     seconds=time.perf_counter() - started, failure=failure, program=program,
                     divergence=divergence, first_failure_examples=tracker.first_examples,
                     first_failure_seconds=tracker.first_seconds, engine_steps=engine_steps,
                     device=str(device), seed=seed, error_type=error_type, reproduce_blob=blob,
                     shrunk=error is not None, interrupted=interrupted,
                     database_key=None if key is None else key.hex(),
                     in_teardown=final is not None and final.in_teardown)


def _runnable_program(notes: list[str]) -> str | None:
    """The ``state = ...`` through ``state.teardown()`` lines of Hypothesis's report, and nothing
    else: its header ("Falsifying example:", "Failing test case: <state machine>" from 6.16x on)
    and trailing notes change between releases and are not Python."""
    lines = "\n".join(notes).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("state = ")), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if lines[i] == "state.teardown()"), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def _seeds(seed: int | None):
    base = 0 if seed is None else seed
    k = 0
    while True:
        yield base + k
        k += 1


def resolved_backup_mode(config, faults, backup_mode=None, family_factory=None) -> str:
    """The retraction path a family of this config, faults and (plug-in) factory runs with."""
    if family_factory is None:
        from poolfuzz.pools.family import build_family as family_factory
    try:
        return family_factory(config, device="cpu", faults=faults, backup_mode=backup_mode).backup_mode
    except Exception:
        return backup_mode or "unknown"
