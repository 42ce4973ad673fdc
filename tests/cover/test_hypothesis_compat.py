"""Each private Hypothesis name poolfuzz uses works on the installed release (one test per name),
and a release without one fails loudly, naming it and the version."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from poolfuzz.harness import hypothesis_compat as compat


class Boom(Exception):
    pass


def _failing_test(seen: list):
    @settings(database=None, derandomize=True, max_examples=50)
    @given(st.integers(0, 100))
    def test(x):
        seen.append((compat.in_final_replay(), compat.current_reproduction()))
        if x > 10:
            raise Boom(x)

    return test


def test_current_build_context_final_replay():
    """in_final_replay is False while exploring and True only in the replay Hypothesis reports."""
    assert compat.in_final_replay() is False  # outside any test
    seen = []
    with pytest.raises(Boom):
        _failing_test(seen)()
    assert seen[-1][0] is True and not any(final for final, _ in seen[:-1])


def test_reproduction_decorator():
    """current_reproduction is a @reproduce_failure line that Hypothesis itself reads back."""
    assert compat.current_reproduction() is None
    seen = []
    with pytest.raises(Boom):
        _failing_test(seen)()
    line = seen[-1][1]
    assert line.startswith("@reproduce_failure(") and compat.reproduction_in(["x", line]) == line


def test_with_reporter(capsys):
    """silenced() keeps Hypothesis's own report off the terminal."""
    with compat.silenced(), pytest.raises(Boom):
        _failing_test([])()
    assert "Falsifying" not in capsys.readouterr().out


class Counter(RuleBasedStateMachine):
    @rule(n=st.integers(0, 3))
    def step(self, n):
        if n == 3:
            raise Boom(n)


def test_get_state_machine_test_and_function_digest():
    """database_key is the key a plain run files its failure under, and the identity changes it."""
    db = InMemoryExampleDatabase()
    machine = type("Counter", (Counter,), {})
    compat.set_database_identity(machine, b"poolfuzz-test one")
    with pytest.raises(Boom):
        run_state_machine_as_test(machine, settings=settings(database=db, max_examples=100))
    assert compat.database_key(machine) in db.data
    other = type("Counter", (Counter,), {})
    compat.set_database_identity(other, b"poolfuzz-test two")
    assert compat.database_key(other) != compat.database_key(machine)
    test = compat.state_machine_test(machine, settings=settings(database=None, max_examples=5))
    with pytest.raises(Boom):
        test()


def test_runnable_program_from_the_notes():
    notes = ["Falsifying example:", "state = M()", "state.step(n=3)", "state.teardown()", "Explanation: x"]
    assert compat.runnable_program(notes) == "state = M()\nstate.step(n=3)\nstate.teardown()"
    assert compat.runnable_program(["nothing here"]) is None


def test_a_missing_name_fails_loudly_with_the_version(monkeypatch):
    import hypothesis
    import hypothesis.core

    monkeypatch.delattr(hypothesis.core, "reproduction_decorator")
    with pytest.raises(compat.IncompatibleHypothesis) as info:
        compat.private("hypothesis.core", "reproduction_decorator")
    message = str(info.value)
    assert "hypothesis.core.reproduction_decorator" in message and hypothesis.__version__ in message
    assert compat.SUPPORTED in message


def test_the_supported_range_is_what_pyproject_pins():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert f"hypothesis{compat.SUPPORTED}" in project["project"]["dependencies"]


def test_outside_a_test_the_build_context_is_absent():
    from hypothesis.control import current_build_context

    with pytest.raises(InvalidArgument):
        current_build_context()


def _draws():
    seen = []

    @settings(database=None, derandomize=True, max_examples=300)
    @given(st.integers(0, 10**9))
    def test(x):
        seen.append(x)

    test()
    return seen


def test_local_constants_frozen_keeps_a_newly_loaded_modules_literals_out_of_the_draws(tmp_path, monkeypatch):
    """A module loaded mid-session (outside site-packages, not a test file: Hypothesis calls it local)
    changes nothing that a derandomized test draws while the constants are frozen; unfrozen,
    Hypothesis 6.131+ would mix its literal 987654321 into about one draw in forty."""
    import importlib
    import sys

    with compat.local_constants_frozen():
        assert compat.local_constants_are_frozen()
        before = _draws()
        (tmp_path / "poolfuzz_literal_probe.py").write_text("ODD = 987654321\nOTHER = 987654322\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.import_module("poolfuzz_literal_probe")
        try:
            after = _draws()
        finally:
            sys.modules.pop("poolfuzz_literal_probe", None)
    assert before == after
    assert 987654321 not in after and 987654322 not in after
