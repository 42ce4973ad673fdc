"""The state machine over a real engine's family, as tests/sglang and tests/vllm run it."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.harness.hypothesis_compat import forget_machine_class
from poolfuzz.harness.machine import machine_for


@dataclass
class Outcome:
    failure: PoolfuzzFailure | None
    steps: list  # the failing (shrunk) example's engine steps


def fuzz_family(family_factory, config, *, examples: int, steps: int = 30, shrink: bool = True) -> Outcome:
    """Run the state machine over ``family_factory``'s families; the shrunk failure, if any. ``shrink=False``: the
    first failing example as found (for tests that assert what is caught, not how short it gets; shrinking an
    engine family's failure is most of such a test's minutes)."""
    base = machine_for(config, family_factory=family_factory)
    last = {}

    class Tracked(base):
        def __init__(self):
            super().__init__()
            last["engine"] = self.engine

    Tracked.__name__ = "PoolMachine"
    try:
        run_state_machine_as_test(Tracked, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
            report_multiple_bugs=False,  # one shrunk failure, as `poolfuzz run` reports: never an ExceptionGroup
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            **({} if shrink else {"phases": [p for p in Phase if p != Phase.shrink]})))
    except PoolfuzzFailure as exc:
        return Outcome(failure=exc, steps=list(last["engine"].log))
    finally:
        # Hypothesis keeps every machine class it ran for good, and this one holds its last engine (``last``):
        # without this, each call leaks an engine's pools into the rest of the session
        forget_machine_class(Tracked)
        last.clear()
    return Outcome(failure=None, steps=[])


def run_on_changed_engine(prelude: list[str], *, family: str, config: str, out, examples: int = 30):
    """``poolfuzz run --family FAMILY --config CONFIG`` in a fresh interpreter, after ``prelude``: lines
    that change the engine's own classes as a new release would (the family probes a release once per
    process, so each change needs its own)."""
    import subprocess
    import sys

    script = "\n".join([*prelude, "import sys", "from poolfuzz.cli import run_cli",
                        f"sys.exit(run_cli(['run', '--family', {family!r}, '--config', {config!r}, '--examples', "
                        f"'{examples}', '--seed', '1', '--db', 'none', '--out', {str(out)!r}]))"])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)


def assert_api_changed(run, words: str, out) -> None:
    """The run said "API CHANGED" in ``words``, exited 2 and wrote no failure artifact under ``out``."""
    text = run.stdout + run.stderr
    assert run.returncode == 2, text[-3000:]
    assert words in text, text[-3000:]
    written = list(out.rglob("*.json")) if out.exists() else []
    assert not written, f"an API change wrote a failure artifact: {written}"
