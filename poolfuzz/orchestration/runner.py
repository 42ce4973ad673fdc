"""Runs the state machine for one (config, faults, backup mode) and returns what happened.

Besides Hypothesis's own report, the runner keeps the failure as an engine-level program
(:mod:`poolfuzz.harness.program`): every failing example Hypothesis runs while it shrinks is
offered to ``on_failure`` when it is the smallest so far, so an interrupted or time-limited run
still hands back (and lets the caller write) its best shrink.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable, UnsatisfiedAssumption

from poolfuzz.errors import ConfigError, EngineApiChanged, api_change_in
from poolfuzz.harness.failures import (
    PoolfuzzFailure, bug_key,
    divergence_of,
    message_of,
    signature_of,
)
from poolfuzz.harness.hypothesis_compat import (
    current_reproduction,
    database_key,
    forget_machine_class,
    in_final_replay,
    reproduction_in,
    runnable_program,
    local_constants_frozen,
    silenced,
    state_machine_test,
)
from poolfuzz.harness.machine import machine_for
from poolfuzz.harness.minimise import minimise
from poolfuzz.harness.program import new_engine
from poolfuzz.harness.records import EngineOptions
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.orchestration.display import add_pools
from poolfuzz.pools.capabilities import PoolsOrigin, factory_capabilities
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.family import expected_backup_mode
from poolfuzz.strategies import DRAWN_NAME


@dataclass(frozen=True, kw_only=True)
class RunResult:
    config: str
    faults: tuple[str, ...]
    backup_mode: str
    examples: int  # examples run up to and including the first failing one (all of them, if none failed)
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
    shrink_examples: int = 0  # examples Hypothesis ran after the first failure, shrinking it
    signature: str | None = None  # the shrunk failure's signature (failures.signature_of)
    skipped: dict = field(default_factory=dict)  # signature -> failing examples of known bugs, rejected
    waived: dict = field(default_factory=dict)  # check -> violations of waived checks, counted
    model_config: ModelConfig | None = None  # the config the reported failure ran on (drawn: its own)
    hypothesis_steps: int | None = None  # steps of Hypothesis's shrink, before steps were deleted here
    # The engine no longer has what the family reads (errors.EngineApiChanged): the run stopped there,
    # untested, and this is its verdict ("API CHANGED: ..."); never a failure, never an artifact.
    api_changed: str | None = None
    declined: int = 0  # examples (counted in ``examples``) whose drawn config the family declined: untested
    declined_reasons: dict = field(default_factory=dict)  # reason -> declined examples
    pools: dict = field(default_factory=dict)  # who built the pools (built_by -> {detail: examples that ran on them})
    pools_origin: PoolsOrigin | None = None  # who built the pools the reported failure ran on

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
    signature: str  # failures.signature_of: names the bug, not the example
    reproduce: str | None = None  # @reproduce_failure(...) for this example
    model_config: ModelConfig | None = None  # the config the example ran on (drawn or given)
    pools_origin: PoolsOrigin | None = None  # who built the pools it ran on (None: none were, or the family says not)

    @property
    def size(self) -> tuple[int, int]:
        return (len(self.steps), sum(len(repr(s.args)) for s in self.steps))


class _BudgetSpent(KeyboardInterrupt):
    """Raised from a new example when the time budget or shrink limit is spent; not a failure.

    A KeyboardInterrupt, because that is what Hypothesis lets through untouched: it neither
    saves the example nor replays it."""


class _ApiChanged(KeyboardInterrupt):
    """Raised in place of an example's EngineApiChanged: the run stops untested, and Hypothesis
    neither shrinks, saves nor replays the example (a KeyboardInterrupt, as ``_BudgetSpent``)."""


@dataclass
class _Tracker:
    """The machine's observer for one run: counts examples and steps, keeps the failures."""

    started: float
    deadline: float | None
    shrink_limit: float | None
    on_progress: Callable | None
    on_failure: Callable | None
    max_examples: int | None = None  # no new example is generated past this many
    known: frozenset = frozenset()  # signatures of bugs found before: rejected, counted, not reported
    skipped: dict = field(default_factory=dict)  # signature -> failing examples of known bugs
    waived: dict = field(default_factory=dict)  # check -> violations of waived checks
    examples: int = 0  # examples run (Hypothesis's replays of failures included)
    steps: int = 0
    first_examples: int | None = None
    first_seconds: float | None = None
    best: FailureCandidate | None = None
    last: FailureCandidate | None = None
    backup_mode: str | None = None  # the retraction path the families ran, from the first engine
    api_changed: EngineApiChanged | None = None  # what stopped the run: the engine's API, not a bug
    declined: int = 0  # examples whose drawn config the family declined: started, rejected, untested
    declined_reasons: dict = field(default_factory=dict)  # reason -> declined examples
    pools: dict = field(default_factory=dict)  # built_by -> {detail: examples run on pools built so}

    # --- MachineObserver ----------------------------------------------------------------------
    def example_started(self) -> None:
        now = time.perf_counter()
        if self.examples and not in_final_replay():
            if self.first_seconds is None and self.deadline is not None and now >= self.deadline:
                raise _BudgetSpent()
            if self.first_seconds is None and self.max_examples is not None and self.examples >= self.max_examples:
                raise _BudgetSpent()  # Hypothesis counts valid examples only; the budget is every example
            if (self.first_seconds is not None and self.shrink_limit is not None
                    and now - self.started - self.first_seconds >= self.shrink_limit):
                raise _BudgetSpent()
        self.examples += 1
        if self.on_progress is not None:
            self.on_progress(self.snapshot())

    def step_ran(self, engine) -> None:
        self.steps += 1
        if self.backup_mode is None:
            self.backup_mode = engine.backup_mode

    def example_failed(self, engine, exc, steps, in_teardown) -> bool:
        change = api_change_in(exc)
        if change is not None:
            self.api_changed = change
            raise _ApiChanged()
        signature = signature_of(exc, in_teardown=in_teardown, op=engine.action)
        taint = getattr(engine, "taint", None)  # an engine that could not be built has none
        downstream = bool(taint) and (engine.tainted(exc.divergence) if isinstance(exc, PoolfuzzFailure)
                                      else engine.crash_downstream(exc))
        if bug_key(signature) in self.known or downstream:
            self.skipped[signature] = self.skipped.get(signature, 0) + 1
            return True
        self.saw_failure(FailureCandidate(
            steps=steps, error_type=type(exc).__name__, message=message_of(exc),
            divergence=divergence_of(exc, engine), in_teardown=in_teardown,
            backup_mode=engine.backup_mode, signature=signature, reproduce=current_reproduction(),
            model_config=engine.config, pools_origin=engine.pools_origin))
        return False

    def example_declined(self, config, reason) -> None:
        if self.first_examples is not None:  # while shrinking: examples are counted up to the first failure
            return
        self.declined += 1
        self.declined_reasons[reason] = self.declined_reasons.get(reason, 0) + 1

    def example_ended(self, engine) -> None:
        origin = engine.pools_origin
        if origin is not None and self.first_examples is None:  # counted up to the first failure, as examples are
            details = self.pools.setdefault(origin.built_by, {})
            details[origin.detail] = details.get(origin.detail, 0) + 1
        for check, n in engine.waived.items():
            self.waived[check] = self.waived.get(check, 0) + n
        for signature, n in engine.passed_over.items():
            self.skipped[signature] = self.skipped.get(signature, 0) + n

    # --- the run's view -----------------------------------------------------------------------
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


def prepare_process() -> None:
    """Set a fuzzing process up once, before its first run: one intra-op thread (the pools are tiny:
    more threads only spin against each other), and everything imported so far (torch, Hypothesis,
    the pools) moved out of the garbage collector's sight. About a third of a run is cyclic
    collection, and every full collection rescanned those long-lived objects."""
    import gc

    import torch

    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """Between configs: drop the cached rows and checksums of the config just fuzzed (no other config
    shares their keys), collect, and hand the freed heap back to the system where the C library can
    (glibc's malloc_trim). Without the last step a long run's RSS climbed at every config although
    nothing was held: torch's CPU tensors are plain malloc'd memory, kept by the allocator's arenas."""
    import ctypes
    import gc

    from poolfuzz.harness import row_cache

    row_cache.release()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is freed, just not handed back
        pass


def run_machine(config, *, device="cpu", faults=(), backup_mode=None, max_examples=100,
                steps_per_example=40, seed: int | None = None, database=None,
                time_budget: float | None = None, round_examples: int = 500,
                shrink_limit: float | None = None, on_progress: Callable[[dict], None] | None = None,
                on_failure: Callable[[FailureCandidate], None] | None = None,
                family_factory=None, options: EngineOptions = EngineOptions(),
                minimise_seconds: float = 10.0) -> RunResult:
    """Fuzz one configuration (a ModelConfig, or a strategy of them: each example draws its own);
    shrink and report the first failure, if any.

    With ``time_budget`` (seconds) it runs rounds of ``round_examples`` examples, each with the
    next seed, until the budget is spent or a failure is found; the budget is checked before each
    example. ``shrink_limit`` (seconds after the first failure) cuts shrinking short and reports the
    best shrink so far. ``seed`` None with no database is derandomized. Ctrl-C returns the result
    so far with ``interrupted`` set. ``on_progress(snapshot)`` is called before every example and
    ``on_failure(candidate)`` whenever a smaller failing example is seen. A failure whose
    signature is in ``options.known`` is counted (``RunResult.skipped``), never reported or shrunk: the
    example is rejected and the search goes on. ``options.waive`` names checks that count their
    violations instead of failing. ``minimise_seconds`` (0: off) bounds the last pass over the reported
    program, which deletes the steps Hypothesis could not (see ``harness.minimise``).
    """
    started = time.perf_counter()
    tracker = _Tracker(started=started, deadline=None if time_budget is None else started + time_budget,
                       shrink_limit=shrink_limit, on_progress=on_progress, on_failure=on_failure,
                       max_examples=None if time_budget is not None else max_examples,
                       known=frozenset(bug_key(s) for s in options.known))
    machine = _machine(config, device=device, faults=faults, backup_mode=backup_mode, options=options,
                       family_factory=family_factory, observer=tracker)
    # its program is scheduler ops: no Engine to minimise on
    scheduled = factory_capabilities(family_factory).drives_scheduler
    key = database_key(machine)
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
            if round_seed is not None:
                # @seed on the machine class, as Hypothesis documents for state machines (on the
                # test function it would also switch the example database off).
                hypothesis_seed(round_seed)(machine)
            test = state_machine_test(machine, settings=chosen)
            # no literals from loaded modules: the same seed draws the same examples in any process
            with silenced(), local_constants_frozen():
                test()
            if time_budget is None or time.perf_counter() - started >= time_budget:
                break
    except _BudgetSpent:
        pass
    except _ApiChanged:
        error = None
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # the shrunk failure (or a crash in the pools, or a flaky one)
        error = exc
    finally:
        forget_machine_class(machine)  # Hypothesis would keep it (and the tracker) for good

    if tracker.api_changed is not None:  # untested, not failed: nothing of the example is kept
        return _api_changed_result(config, faults, backup_mode, tracker, started, device, seed)
    if isinstance(error, (UnsatisfiedAssumption, Unsatisfiable)):  # every example hit a known bug: nothing new
        error = None
    final = tracker.last if error is not None else tracker.best
    failure = program = blob = divergence = error_type = None
    engine_steps: tuple = ()
    if error is not None:
        failure, error_type = message_of(error), type(error).__name__
        notes = getattr(error, "__notes__", [])
        program = runnable_program(notes)
        blob = reproduction_in(notes)
        # A crash's divergence is the one seen with its engine; a poolfuzz failure carries its own.
        divergence = (final.divergence if final is not None and not isinstance(error, PoolfuzzFailure)
                      else divergence_of(error))
    elif final is not None:  # stopped or interrupted while shrinking: the best so far
        failure, error_type, divergence = final.message, final.error_type, final.divergence
    if final is not None:
        engine_steps = final.steps
        blob = blob or final.reproduce
    hypothesis_steps = None
    signature = _signature(error, final)
    shorter = None
    if final is not None and signature is not None and minimise_seconds and len(engine_steps) > 1 and not scheduled:
        try:  # a Ctrl-C here keeps Hypothesis's shrink: the artifact must still be written as final
            shorter = minimise(list(engine_steps), bug=bug_key(signature), max_seconds=minimise_seconds,
                               new_engine=lambda: new_engine(config=final.model_config or config, device=device,
                                                             faults=faults, backup_mode=backup_mode,
                                                             family_factory=family_factory,
                                                             options=dataclasses.asdict(options)))
        except KeyboardInterrupt:
            interrupted = True
        if shorter is not None and len(shorter.steps) < len(engine_steps):
            hypothesis_steps, engine_steps = len(engine_steps), tuple(shorter.steps)
            got = shorter.replayed
            failure, error_type = message_of(got.failure), type(got.failure).__name__
            divergence = got.divergence
            signature = signature_of(got.failure, in_teardown=got.in_teardown, op=got.op)
            final = dataclasses.replace(final, in_teardown=got.in_teardown)
    mode = final.backup_mode if final is not None else tracker.backup_mode
    drawn = not isinstance(config, ModelConfig)
    if mode is None:  # no engine was built: the built-in family's answer, or what was asked for
        mode = (backup_mode or "unknown") if drawn else expected_backup_mode(config, faults, backup_mode,
                                                                              family_factory, fallback="unknown")
    # Examples are those run before the first failure; shrinking runs are counted apart.
    examples = tracker.examples if tracker.first_examples is None else tracker.first_examples
    return RunResult(config=DRAWN_NAME if drawn else config.name, faults=tuple(faults), backup_mode=mode,
                     examples=examples, shrink_examples=tracker.examples - examples, steps=tracker.steps,
                     seconds=time.perf_counter() - started, failure=failure, program=program,
                     divergence=divergence, first_failure_examples=tracker.first_examples,
                     first_failure_seconds=tracker.first_seconds, engine_steps=engine_steps,
                     device=str(device), seed=seed, error_type=error_type, reproduce_blob=blob,
                     shrunk=error is not None, interrupted=interrupted, database_key=key.hex(),
                     in_teardown=final is not None and final.in_teardown,
                     signature=signature, hypothesis_steps=hypothesis_steps,
                     skipped=dict(tracker.skipped), waived=dict(tracker.waived),
                     model_config=final.model_config if final is not None else None,
                     declined=tracker.declined, declined_reasons=dict(tracker.declined_reasons),
                     pools=add_pools({}, tracker.pools), pools_origin=final.pools_origin if final is not None else None)


def _machine(config, *, device, faults, backup_mode, options, family_factory, observer):
    """The state machine a run drives: the engine's own scheduler (a factory that ``drives_scheduler`` builds its
    driver) or the Engine machine over pool families."""
    caps = factory_capabilities(family_factory)
    if not caps.drives_scheduler:
        return machine_for(config, device=device, faults=faults, backup_mode=backup_mode, options=options,
                           family_factory=family_factory, observer=observer)
    def driver(model: ModelConfig):
        return family_factory(model, device=device, faults=tuple(faults), backup_mode=backup_mode)

    if not isinstance(config, ModelConfig) and not caps.takes_drawn_configs:
        raise ConfigError("this family drives the engine's scheduler over named configs only, not drawn ones")
    decline = None if caps.unsupported_reason is None else (
        lambda model: caps.decline_reason(model, backup_mode=backup_mode))
    identity = f"{getattr(family_factory, '__module__', '')}.{getattr(family_factory, '__qualname__', '')}"
    return scheduled_machine(config, driver_factory=driver, observer=observer, identity=identity, decline=decline,
                             shape=caps.model_shaped)


def _api_changed_result(config, faults, backup_mode, tracker: _Tracker, started: float, device, seed) -> RunResult:
    drawn = not isinstance(config, ModelConfig)
    return RunResult(config=DRAWN_NAME if drawn else config.name, faults=tuple(faults),
                     backup_mode=tracker.backup_mode or backup_mode or "unknown", examples=tracker.examples,
                     steps=tracker.steps, seconds=time.perf_counter() - started, failure=None, program=None,
                     divergence=None, device=str(device), seed=seed, skipped=dict(tracker.skipped),
                     waived=dict(tracker.waived), api_changed=tracker.api_changed.verdict,
                     declined=tracker.declined, declined_reasons=dict(tracker.declined_reasons),
                     pools=add_pools({}, tracker.pools))


def _signature(error: BaseException | None, final: FailureCandidate | None) -> str | None:
    """The reported failure's signature: Hypothesis's shrunk error where it is a poolfuzz failure,
    else (a crash, or a run cut short while shrinking) the best failing example's."""
    if isinstance(error, PoolfuzzFailure):
        return signature_of(error, in_teardown=final is not None and final.in_teardown)
    if final is not None:
        return final.signature
    return None if error is None else signature_of(error)


def _seeds(seed: int | None):
    base = 0 if seed is None else seed
    k = 0
    while True:
        yield base + k
        k += 1
