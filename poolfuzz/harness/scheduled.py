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

Not yet wired into ``poolfuzz run`` (artifacts, replay, emit-test): issue 30's next step.
"""

from __future__ import annotations

import sys
from typing import Callable, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poolfuzz.harness.failures import Divergence, StateLost, invariant as invariant_failure
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import LostKv


def _lost(exc: LostKv) -> StateLost:
    d = Divergence(kind="state-lost", step=exc.step, op="schedule", rid=int(exc.rid) if exc.rid.isdigit() else None,
                   component=exc.component, layer=exc.layer, position=exc.position, slot_after=exc.slot,
                   expected=exc.expected, found=exc.found, check="contents", space=exc.space, detail=str(exc))
    return StateLost(d, str(exc))


class ScheduledMachine(RuleBasedStateMachine):
    """Traffic for an engine's scheduler (configure it with :func:`scheduled_machine`)."""

    config: ClassVar[ModelConfig]
    driver_factory: ClassVar[Callable]  # (config) -> a driver (add_request, step, abort, live, tables_problem, drain)

    def __init__(self):
        super().__init__()
        self.driver = type(self).driver_factory(type(self).config)
        self.steps = 0

    def _run(self, action) -> None:
        try:
            action()
        except LostKv as exc:
            raise _lost(exc) from None

    @rule(length=st.integers(1, 24), share=st.integers(0, 4), max_tokens=st.integers(1, 8))
    def add_request(self, length, share, max_tokens):
        """A request arrives; ``share`` > 0 starts it with a prefix of an earlier request's tokens."""
        self.driver.add_request(length=length, share=share, max_tokens=max_tokens)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.steps += 1
            self._run(self.driver.step)

    @precondition(lambda self: bool(self.driver.live()))
    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        live = self.driver.live()
        self.driver.abort(live[pick % len(live)])

    @invariant()
    def tables_agree(self):
        problem = self.driver.tables_problem()
        if problem:
            raise invariant_failure(step=self.steps, op="schedule", detail=problem, check="consumer-map")

    def teardown(self):
        if sys.exc_info()[1] is not None:  # a step failed: its report stands, nothing more to check
            return
        problem = None
        try:
            problem = self.driver.drain()
        except LostKv as exc:
            raise _lost(exc) from None
        if problem:
            raise invariant_failure(step=self.steps, op="drain", detail=problem, check="leak")


def scheduled_machine(config: ModelConfig, *, driver_factory: Callable) -> type[ScheduledMachine]:
    """A ScheduledMachine bound to one config and an engine's driver factory."""
    return type("ScheduledMachine", (ScheduledMachine,), dict(config=config, driver_factory=staticmethod(driver_factory)))
