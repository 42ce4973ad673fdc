"""Tests against the real vLLM installed in this environment (CI installs two, each in its own venv).

``POOLFUZZ_VLLM_EXPECT`` says what the installed release must do: ``pass`` (0.24.0 on) or ``44409``
(a release before PR #44409). CI sets it, and then a missing or broken vLLM is a failure. Without it
a missing vLLM skips, and the expectation is read from the installed version.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.harness.machine import machine_for

EXPECT = os.environ.get("POOLFUZZ_VLLM_EXPECT")


@pytest.fixture(scope="session")
def api():
    from poolfuzz.adapters.vllm.api import load
    from poolfuzz.pools.errors import ConfigError

    try:
        return load()
    except ConfigError as exc:
        if EXPECT:
            pytest.fail(f"POOLFUZZ_VLLM_EXPECT={EXPECT} but vLLM is unusable here: {exc}")
        pytest.skip(f"vLLM is not installed in this environment ({exc}); CI runs these in its vLLM venvs")


@pytest.fixture(scope="session")
def expect(api) -> str:
    if EXPECT:
        assert EXPECT in ("pass", "44409"), f"POOLFUZZ_VLLM_EXPECT must be pass or 44409, got {EXPECT!r}"
        return EXPECT
    major, minor = (int(x) for x in api.version.split(".")[:2])
    return "pass" if (major, minor) >= (0, 24) else "44409"


@dataclass
class Outcome:
    failure: PoolfuzzFailure | None
    steps: list  # the failing (shrunk) example's engine steps


def _fuzz(config, *, examples: int, steps: int = 30) -> Outcome:
    """Run the state machine over the vllm family; the shrunk failure, if any."""
    from poolfuzz.adapters.vllm import build_family

    base = machine_for(config, family_factory=build_family)
    last = {}

    class Tracked(base):
        def __init__(self):
            super().__init__()
            last["engine"] = self.engine

    Tracked.__name__ = "PoolMachine"
    try:
        run_state_machine_as_test(Tracked, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    except PoolfuzzFailure as exc:
        return Outcome(failure=exc, steps=list(last["engine"].log))
    return Outcome(failure=None, steps=[])


@pytest.fixture
def fuzz():
    """``fuzz(config, examples=N)``: the state machine over the vllm family, shrunk failure if any."""
    return _fuzz
