"""The state machine over an engine's own scheduler: requests arrive, the scheduler schedules, a worker runs.

Where :class:`~poolfuzz.harness.machine.PoolMachine` plays the scheduler itself over a family's pools, this
machine leaves every decision to the engine's scheduler (which request runs, how far a chunk goes, which
blocks it gets, who is preempted and when it resumes) and only makes the traffic: requests of drawn lengths,
sharing drawn prefixes with earlier ones, with drawn ``max_tokens``; scheduler steps; aborts. An engine's
*driver* (``adapters/vllm/scheduling.SchedulerDriver``) builds the scheduler and its worker stand-in, whose
forward checks that every position it attends to holds the request's own KV, and that a recurrent state it
continues from is the state of exactly the tokens the scheduler says are computed (``LostKv``, reported here as
StateLost); after every rule the worker's block tables must be the scheduler's, and at teardown the idle server
must finish every request, hold no block and reset its prefix cache.

``poolfuzz run`` drives it for a family whose factory declares ``drives_scheduler`` (``--family vllm``):
the factory builds the driver. The machine tells the run's observer what the Engine machine tells it (an example
starts, a scheduler step ran, an example failed, with its program so far as :class:`StepRecord` ops
``scheduler.add_request`` / ``scheduler.schedule`` / ``scheduler.abort``, an example ended), and stands in for the
engine the observer reads (``config``, ``backup_mode``, ``pools_origin``, ``step``, ``op``, ``action``).
:func:`replay` re-runs such a program on a fresh driver.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from poolfuzz.harness.failures import Divergence, StateLost, invariant as invariant_failure
from poolfuzz.harness.hypothesis_compat import set_database_identity
from poolfuzz.harness.machine import DeclineLog
from poolfuzz.harness.records import StepRecord
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, LostKv, RowOverflow, ServerStuck
from poolfuzz.strategies import DRAWN_NAME, drawn_configs, token_unit

PREFIX = "scheduler."  # the ops of a scheduler program, apart from the Engine's (harness.program.operations)
INIT_OP = "init"  # the operation a server that crashes while it starts is recorded at
# Each op of a scheduler program and the arguments it takes: what an artifact's program may hold.
OPERATIONS: dict[str, tuple[str, ...]] = {f"{PREFIX}add_request": ("length", "share", "max_tokens", "priority"),
                                          f"{PREFIX}schedule": ("steps", "drafts"), f"{PREFIX}abort": ("pick",),
                                          f"{PREFIX}session_turn": ("session", "length", "max_tokens"),
                                          f"{PREFIX}close_session": ("session",), f"{PREFIX}flush": ()}
SESSION_OPERATIONS = ("session_turn", "close_session")  # only for a driver whose streaming_sessions is True
# Arguments an older program may lack (each then 0).
OPTIONAL = {f"{PREFIX}schedule": {"drafts"}, f"{PREFIX}add_request": {"priority"}}
BACKUP_MODE = "cpu_tensor"  # what an artifact records before a driver is built (its own backup_mode after)


def _lost(exc: LostKv) -> StateLost:
    d = Divergence(kind="state-lost", step=exc.step, op="schedule", rid=int(exc.rid) if exc.rid.isdigit() else None,
                   component=exc.component, layer=exc.layer, position=exc.position, slot_after=exc.slot,
                   expected=exc.expected, found=exc.found, check="contents", space=exc.space, detail=str(exc))
    return StateLost(d, str(exc))


class ScheduledMachine(RuleBasedStateMachine):
    """Traffic for an engine's scheduler (configure it with :func:`scheduled_machine`)."""

    config: ClassVar[ModelConfig]
    driver_factory: ClassVar[Callable]  # (config) -> a driver (add_request, step, abort, live, propose_drafts,
    # state_problem, drain, close; where its ``streaming_sessions`` is True, also session_turn and close_session;
    # where its ``flushes`` is True, also flush; its
    # ``backup_mode``, the retraction path it runs, is what an artifact records, and its ``pools_origin``, a
    # pools.capabilities.PoolsOrigin, who built the pools it runs on)
    observer: ClassVar[object | None] = None  # a harness.machine.MachineObserver (a run's counts and failures)
    backup_mode = BACKUP_MODE

    # Set (by scheduled_machine) when each example draws its config: the server is then started by start_server, an
    # initialize rule, and a draw the family declines rejects the example (counted, never reported).
    config_strategy: ClassVar[st.SearchStrategy[ModelConfig] | None] = None
    decline_log: ClassVar[DeclineLog | None] = None  # drawn configs: why the family refused the last draw

    def __init__(self):
        super().__init__()
        cls = type(self)
        if cls.observer is not None:
            cls.observer.example_started()
        if cls.decline_log is not None:
            cls.decline_log.last = None
        self.steps = 0
        self.program: list[StepRecord] = []
        self.op = self.action = INIT_OP
        self.waived: dict = {}  # what an observer reads of an engine at the example's end (nothing is waived here)
        self.passed_over: dict = {}
        self.driver = None
        self.server_closed = False
        self.told_failure = False  # whether this example's failure reached the observer
        self.unit = 1
        if cls.config_strategy is None:
            self._start(cls.config, drawn=False)

    def _start(self, config: ModelConfig, *, drawn: bool) -> None:
        """Start the example's server on ``config`` (the instance's ``config`` from here on, which an artifact
        records). A drawn config the family declines while building (a ConfigError) rejects the example."""
        cls = type(self)
        self.config = config
        # Prompts in the pool machine's units: a config of 64-token pages gets prompts that fill pages, so chunks and
        # page-granular prefix hits happen. The program records the drawn units, so a replay scales them once.
        self.unit = token_unit(config)
        declined: list[ConfigError] = []

        def build():
            try:
                return cls.driver_factory(config)
            except ConfigError as exc:
                if not drawn:
                    raise
                declined.append(exc)
                return None

        self.driver = self._guarded(INIT_OP, build)  # a server that crashes at startup is a failure like any other
        if declined:
            if cls.observer is not None:
                cls.observer.example_declined(config, str(declined[0]))
            reject()
        if self.driver is not None:
            self.backup_mode = self.driver.backup_mode

    @property
    def step(self) -> int:  # the engine's step an observer reads (divergence_of)
        return self.steps

    @property
    def pools_origin(self):  # who built the pools the example's server runs on (None: no server started)
        return None if self.driver is None else self.driver.pools_origin

    def _guarded(self, op: str, action, *, in_teardown: bool = False):
        """Run ``action``; a failure is told to the observer first (a known bug rejects the example)."""
        self.op = self.action = op
        try:
            return action()
        except LostKv as exc:
            self._failed(_lost(exc), in_teardown)
        except (ServerStuck, RowOverflow) as exc:  # checks of their own: a request never finished, a row overrun
            check, held = ("stuck", exc.held) if isinstance(exc, ServerStuck) else ("row-bounds", None)
            self._failed(invariant_failure(step=self.steps, op=op, detail=str(exc), check=check, space=held),
                         in_teardown)
        except Exception as exc:  # an assert or crash inside the engine, or a check of ours
            self._failed(exc, in_teardown)

    def _failed(self, exc: BaseException, in_teardown: bool):
        self.told_failure = True
        observer = type(self).observer
        if observer is not None and observer.example_failed(self, exc, tuple(self.program), in_teardown):
            reject()  # a known bug: neither reported nor shrunk
        raise exc

    def _record(self, op: str, **args) -> None:
        self.program.append(StepRecord(op=PREFIX + op, args=args, outcome=""))

    def _outcome(self, outcome: str) -> None:
        """What the step just recorded resolved to (the request it admitted, the flush it did or was refused)."""
        self.program[-1] = dataclasses.replace(self.program[-1], outcome=outcome)

    @rule(length=st.integers(1, 24), share=st.integers(0, 4), max_tokens=st.integers(1, 8), priority=st.integers(0, 2))
    def add_request(self, length, share, max_tokens, priority=0):
        """A request arrives; ``share`` > 0 starts it with a prefix of an earlier request's tokens; ``priority``
        orders it where the server schedules by priority."""
        self._record("add_request", length=length, share=share, max_tokens=max_tokens, priority=priority)
        rid = self._guarded("add_request", lambda: self.driver.add_request(
            length=length * self.unit, share=share, max_tokens=max_tokens, priority=priority))
        self._outcome(f"req {rid}{self._tokens(length)}")

    def _tokens(self, length: int) -> str:
        """The prompt's new tokens, where a drawn length is not a token count (the program records what was drawn,
        so it replays through the same rule)."""
        return f" ({length * self.unit} new tokens)" if self.unit > 1 else ""

    @rule(steps=st.integers(1, 4), drafts=st.integers(0, 2))
    def schedule(self, steps, drafts=0):
        """``steps`` scheduler steps: ``schedule()``, the worker's forward, ``update_from_output``; on a server
        with speculative decoding the worker's drafter proposes ``drafts`` tokens after each (else ignored)."""
        self._record("schedule", steps=steps, drafts=drafts)
        self._guarded("schedule", lambda: self.driver.propose_drafts(drafts))
        for _ in range(steps):
            self.steps += 1
            self._guarded("schedule", self.driver.step)
            if type(self).observer is not None:
                type(self).observer.step_ran(self)

    @precondition(lambda self: self.driver.streaming_sessions)
    @rule(session=st.integers(0, 1), length=st.integers(1, 24), max_tokens=st.integers(1, 8))
    def session_turn(self, session, length, max_tokens):
        """The next turn of streaming session ``session`` (opened by its first turn): ``length`` new tokens after
        the session's context, which the server keeps between turns (a server with streaming sessions). Sent only
        once the session's last turn is answered, as a client sends them (else the driver returns None)."""
        self._record("session_turn", session=session, length=length, max_tokens=max_tokens)
        rid = self._guarded("session_turn", lambda: self.driver.session_turn(session=session, length=length * self.unit,
                                                                            max_tokens=max_tokens))
        outcome = f"req {rid}{self._tokens(length)}" if rid else "the client waits: the session's last turn is in flight"
        self._outcome(outcome)

    @precondition(lambda self: self.driver.streaming_sessions)
    @rule(session=st.integers(0, 1))
    def close_session(self, session):
        """The client closes streaming session ``session`` (nothing happens where it is not open): the server frees
        what the session held."""
        self._record("close_session", session=session)
        self._guarded("close_session", lambda: self.driver.close_session(session))

    @precondition(lambda self: self.driver.flushes)
    @rule()
    def flush(self):
        """An operator flushes the server's cache (SGLang's ``/flush_cache``): done only when the server is idle
        (its tree reset, every pool and allocator cleared), else refused; either way the server goes on serving."""
        self._record("flush")
        done = self._guarded("flush", self.driver.flush)
        self._outcome("flushed" if done else "refused: the server is not idle")

    @precondition(lambda self: bool(self.driver.live()))
    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        """Abort the ``pick``-th live request. Called with none live (an emitted test on an engine that now finishes
        the request sooner), there is nothing to abort."""
        self._record("abort", pick=pick)
        live = self.driver.live()
        if live:
            self._guarded("abort", lambda: self.driver.abort(live[pick % len(live)]))

    @invariant()
    def server_state_agrees(self):
        # guarded: where the engine's own checker crashes (0.5.10's busy check asks MambaRadixCache.evictable_size,
        # which raises NotImplementedError), that is this example's failure, recorded as the others are
        problem = self._guarded("schedule", self.driver.state_problem)
        if problem:
            self._failed(invariant_failure(step=self.steps, op="schedule", detail=problem, check="consumer-map"),
                         False)

    def close_server(self) -> None:
        """Close the example's server once (nothing of it outlives the example: storage threads, files)."""
        if self.driver is not None and not self.server_closed:
            self.server_closed = True
            self.driver.close()

    def teardown(self):
        try:
            if self.driver is None:  # never started: its failure stands, or every draw was one the family declines
                log = type(self).decline_log
                if log is not None and log.last is not None and type(self).observer is not None:
                    type(self).observer.example_declined(None, log.last)
                return
            failure = sys.exc_info()[1]
            if failure is not None:  # a step failed: its report stands, told to the observer whatever raised it
                if (isinstance(failure, Exception) and not isinstance(failure, HypothesisException)
                        and not self.told_failure):
                    self._failed(failure, False)  # a failure the observer never heard of would pass unseen
                return
            problem = self._guarded("drain", self.driver.drain, in_teardown=True)
            if problem:
                self._failed(invariant_failure(step=self.steps, op="drain", detail=problem, check="leak"), True)
        finally:
            self.close_server()
            if type(self).observer is not None:
                type(self).observer.example_ended(self)


def scheduled_machine(config: ModelConfig | str | st.SearchStrategy, *, driver_factory: Callable, observer=None, identity: str = "",
                      decline: Callable[[ModelConfig], str | None] | None = None,
                      shape: Callable[[ModelConfig], ModelConfig] | None = None) -> type[ScheduledMachine]:
    """A ScheduledMachine bound to one config (or ``"random"``: each example draws its own, from
    :func:`~poolfuzz.strategies.drawn_configs` reshaped by ``shape``, the family's ``model_shaped``, and filtered by
    ``decline``, the family's reason to decline a config; or a strategy of configs, filtered the same) and
    an engine's driver factory; ``observer`` is told what each example does. Its examples are filed in Hypothesis's
    database under a key naming the config and ``identity`` (the family), apart from the Engine machine's."""
    attrs = dict(driver_factory=staticmethod(driver_factory), observer=observer)
    if isinstance(config, ModelConfig):
        attrs["config"], name = config, config.name
    elif config == DRAWN_NAME or isinstance(config, st.SearchStrategy):
        log = attrs["decline_log"] = DeclineLog(decline) if decline is not None else None
        if isinstance(config, st.SearchStrategy):  # a test's own draw (drawn_configs(where=...)), filtered the same
            strategy = config if log is None else config.filter(log.accepts)
        else:
            strategy = drawn_configs(where=None if log is None else log.accepts, shape=shape)
        attrs["config_strategy"] = strategy
        attrs["start_server"] = _drawn_start(strategy)
        name = DRAWN_NAME
    else:
        raise ConfigError(f"a scheduler machine runs a config, a strategy of them or {DRAWN_NAME!r}, not {config!r}")
    cls = type("ScheduledMachine", (ScheduledMachine,), attrs)
    set_database_identity(cls, f"poolfuzz-scheduled/1 config={name} family={identity}".encode())
    return cls


def _drawn_start(strategy: st.SearchStrategy[ModelConfig]):
    @initialize(config=strategy)
    def start_server(self, config):
        """Draw the example's config and start its server (initialize rules run before every other rule)."""
        self._start(config, drawn=True)

    return start_server


@dataclass(frozen=True, kw_only=True)
class Replayed:
    """One step of a replayed scheduler program (``step`` None: building the server, or the teardown)."""

    index: int
    step: StepRecord | None
    failure: BaseException | None = None
    cannot_run: str | None = None  # why the step does not apply here (no live request to abort)
    pools_origin: object = None  # who built the pools the replaying server runs on (None: it was never built)


def check_program(steps) -> str | None:
    """Why ``steps`` is not a scheduler program a replay can run (ops, argument names, ints); None if it is."""
    for i, step in enumerate(steps, 1):
        names = OPERATIONS.get(step.op)
        if names is None:
            return f"step {i} names operation {step.op!r}, not one of {', '.join(OPERATIONS)}"
        given, optional = set(step.args), OPTIONAL.get(step.op, set())
        if not set(names) - optional <= given <= set(names) or not all(type(v) is int and v >= 0
                                                                        for v in step.args.values()):
            return f"step {i} ({step.op}): arguments {step.args} must be {', '.join(names)}, each an int >= 0"
    return None


def replay(machine_cls: type[ScheduledMachine], program) -> Iterator[Replayed]:
    """Run ``program`` (scheduler ops, as a run recorded them) on a fresh server, checking what a run checks;
    one :class:`Replayed` per step, then the teardown's. Stops at the first failure."""
    try:
        machine = machine_cls()
    except Exception as exc:
        yield Replayed(index=0, step=None, failure=exc)
        return
    try:
        for ev in _replayed(machine, program):
            yield dataclasses.replace(ev, pools_origin=machine.pools_origin)
    finally:  # a replay that stops early never reaches the teardown, which closes the server otherwise
        machine.close_server()


def _replayed(machine: ScheduledMachine, program) -> Iterator[Replayed]:
    for i, step in enumerate(program, 1):
        name = step.op.removeprefix(PREFIX)
        if name == "abort" and not machine.driver.live():
            yield Replayed(index=i, step=step, cannot_run="no live request to abort")
            return
        if name in SESSION_OPERATIONS and not machine.driver.streaming_sessions:
            yield Replayed(index=i, step=step, cannot_run="this server keeps no streaming sessions")
            return
        if name == "flush" and not machine.driver.flushes:
            yield Replayed(index=i, step=step, cannot_run="this server's cache is not flushed here")
            return
        try:
            getattr(machine, name)(**step.args)
            machine.server_state_agrees()
        except Exception as exc:
            yield Replayed(index=i, step=step, failure=exc)
            return
        yield Replayed(index=i, step=step)
    try:
        machine.teardown()
    except Exception as exc:
        yield Replayed(index=len(program) + 1, step=None, failure=exc)
        return
    yield Replayed(index=len(program) + 1, step=None)
