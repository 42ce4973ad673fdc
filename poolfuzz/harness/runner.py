"""Runs the state machine for one (config, faults, backup mode) and returns what happened."""

from __future__ import annotations

import time
from dataclasses import dataclass

import contextlib

import hypothesis.core
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.failures import PoolfuzzFailure
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
    program: str | None  # the shrunk program as Hypothesis prints it
    divergence: dict | None
    first_failure_examples: int | None = None  # examples run up to and including the first failing one
    first_failure_seconds: float | None = None
    engine_steps: tuple = ()  # the shrunk failure as engine operations (StepRecord), replayable
    device: str = "cpu"

    @property
    def passed(self) -> bool:
        return self.failure is None


def run_machine(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None, max_examples=100,
                steps_per_example=40, seed: int | None = None, database=None,
                time_budget: float | None = None, round_examples: int = 100) -> RunResult:
    """Fuzz one configuration; shrink and report the first failure, if any.

    With ``time_budget`` (seconds) it runs rounds of ``round_examples`` examples, each with the
    next seed, until the budget is spent or a failure is found.
    """
    machine = machine_for(config, device=device, faults=faults, backup_mode=backup_mode)
    counters = {"examples": 0, "steps": 0, "first_examples": None, "first_seconds": None, "engine": None}
    started = time.perf_counter()

    class Counted(machine):
        def __init__(self):
            super().__init__()
            counters["examples"] += 1
            counters["engine"] = self.engine  # after a failure: the final, shrunk reproduction

        def check_invariants(self, *args, **kwargs):  # hypothesis calls this once per step
            counters["steps"] += 1
            return super().check_invariants(*args, **kwargs)

        def teardown(self):
            if self.engine.broken and counters["first_examples"] is None:
                counters["first_examples"] = counters["examples"]
                counters["first_seconds"] = time.perf_counter() - started
            super().teardown()

    Counted.__name__ = Counted.__qualname__ = "PoolMachine"
    chosen = settings(
        max_examples=max_examples, stateful_step_count=steps_per_example, deadline=None, database=database,
        derandomize=seed is None and database is None, print_blob=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    failure = program = divergence = None
    engine_steps = ()
    rounds = [seed] if time_budget is None else _seeds(seed)
    try:
        for round_seed in rounds:
            if time_budget is not None:
                chosen = settings(chosen, max_examples=round_examples, derandomize=False)
            with _forced_seed(round_seed):
                run_state_machine_as_test(Counted, settings=chosen)
            if time_budget is None or time.perf_counter() - started >= time_budget:
                break
    except PoolfuzzFailure as exc:
        failure = str(exc)
        engine_steps = tuple(counters["engine"].log)
        program = "\n".join(n for n in getattr(exc, "__notes__", []) if not n.startswith("You can reproduce"))
        divergence = exc.divergence.to_json()
    return RunResult(config=config.name, faults=tuple(faults),
                     backup_mode=backup_mode or _resolved_mode(config, faults),
                     examples=counters["examples"], steps=counters["steps"],
                     seconds=time.perf_counter() - started, failure=failure, program=program,
                     divergence=divergence, first_failure_examples=counters["first_examples"],
                     first_failure_seconds=counters["first_seconds"], engine_steps=engine_steps,
                     device=str(device))


def _seeds(seed: int | None):
    base = 0 if seed is None else seed
    k = 0
    while True:
        yield base + k
        k += 1


@contextlib.contextmanager
def _forced_seed(seed: int | None):
    """Hypothesis's own global seed (what ``pytest --hypothesis-seed`` sets) for one run."""
    if seed is None:
        yield
        return
    old = hypothesis.core.global_force_seed
    hypothesis.core.global_force_seed = seed
    try:
        yield
    finally:
        hypothesis.core.global_force_seed = old


def _resolved_mode(config, faults) -> str:
    from poolfuzz.pools.family import build_family

    return build_family(config, device="cpu", faults=faults).backup_mode
