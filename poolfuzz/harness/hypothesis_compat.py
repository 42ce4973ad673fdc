"""Every private Hypothesis name poolfuzz relies on, in one module, each resolved at import.

A Hypothesis release that renames one of them makes this import fail with
:class:`IncompatibleHypothesis`, naming the name, the installed version and the supported range,
instead of the harness silently losing its database keys or reproduction blobs.
``tests/cover/test_hypothesis_compat.py`` checks each name against the installed release.
"""

from __future__ import annotations

import importlib
import re
import threading
from contextlib import AbstractContextManager, contextmanager

import hypothesis
from hypothesis.errors import InvalidArgument

from poolfuzz.errors import ConfigError

# The releases the test suite has been run against; pyproject.toml pins the same range.
SUPPORTED = ">=6.100,<6.171"
# The machine-class attribute Hypothesis folds into a state machine's example-database key.
DIGEST_ATTRIBUTE = "_hypothesis_internal_add_digest"


class IncompatibleHypothesis(ConfigError):
    """The installed Hypothesis lacks an internal poolfuzz needs."""


def private(module_name: str, attr: str):
    """``module_name.attr`` from the installed Hypothesis, or IncompatibleHypothesis naming it."""
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise IncompatibleHypothesis(
            f"poolfuzz needs {module_name}.{attr}, which Hypothesis {hypothesis.__version__} does not have; "
            f"install a release poolfuzz supports: pip install 'hypothesis{SUPPORTED}'") from None


_current_build_context = private("hypothesis.control", "current_build_context")
_reproduction_decorator = private("hypothesis.core", "reproduction_decorator")
_with_reporter = private("hypothesis.reporting", "with_reporter")
_function_digest = private("hypothesis.internal.reflection", "function_digest")
_get_state_machine_test = private("hypothesis.stateful", "get_state_machine_test")
# Hypothesis mixes into its draws the literals of every "local" module loaded (6.131 on: not in
# site-packages, not a test file): poolfuzz's own, the engines' shims, a user's conftest, a plug-in a
# test wrote to a temporary directory. Which of them a process has loaded depends on what ran before
# (under xdist, on the order tests reach a worker), so a seed drew other examples in CI than here
# (stop 46's red build). Both names are optional: a release without local constants has nothing to freeze.
_providers = importlib.import_module("hypothesis.internal.conjecture.providers")
_HAS_LOCAL_CONSTANTS = hasattr(_providers, "_get_local_constants") and hasattr(_providers, "CONSTANTS_CACHE")
_freeze_lock = threading.Lock()
_freeze_depth = 0
_thawed = None


@contextmanager
def local_constants_frozen():
    """Within it, Hypothesis draws no literals from loaded modules, so a seed draws the same
    examples in any process, from any path, whatever was imported first. Re-entrant; restores
    Hypothesis's own behaviour when the outermost exit is reached."""
    global _freeze_depth, _thawed
    if not _HAS_LOCAL_CONSTANTS:
        yield
        return
    with _freeze_lock:
        if _freeze_depth == 0:
            from hypothesis.internal.constants_ast import Constants

            none = Constants()
            _thawed = _providers._get_local_constants
            _providers._get_local_constants = lambda: none
            _providers.CONSTANTS_CACHE.cache.clear()  # it holds the local literals already drawn from
        _freeze_depth += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_depth -= 1
            if _freeze_depth == 0:
                _providers._get_local_constants = _thawed
                _providers.CONSTANTS_CACHE.cache.clear()


def local_constants_are_frozen() -> bool:
    """True inside :func:`local_constants_frozen` (on a release with local constants)."""
    return _freeze_depth > 0


def _build_context():
    """The running test's build context, or None outside a test (a program replayed by hand)."""
    try:
        return _current_build_context()
    except InvalidArgument:
        return None


def in_final_replay() -> bool:
    """True while Hypothesis replays the shrunk failing example for its report."""
    context = _build_context()
    return context is not None and bool(context.is_final)


def current_reproduction() -> str | None:
    """``@reproduce_failure(version, blob)`` of the example running now; None outside a test."""
    context = _build_context()
    return None if context is None else _reproduction_decorator(context.data.choices)


def silenced() -> AbstractContextManager[None]:
    """Hypothesis's own report printing switched off (poolfuzz prints its own)."""
    return _with_reporter(lambda *_: None)


def state_machine_test(machine_cls, *, settings):
    """The ``@given`` test that runs ``machine_cls``, as ``run_state_machine_as_test`` builds it."""
    return _get_state_machine_test(machine_cls, settings=settings)


def forget_machine_class(machine_cls) -> None:
    """Drop what Hypothesis keeps of a state-machine class for good (its rules and invariants, in a
    class-level dict never cleared), so a long session's finished machines can be collected."""
    from hypothesis.stateful import RuleBasedStateMachine

    RuleBasedStateMachine._setup_state_per_class.pop(machine_cls, None)


def set_database_identity(machine_cls, identity: bytes) -> None:
    """File ``machine_cls``'s examples under a key derived from ``identity``."""
    setattr(machine_cls, DIGEST_ATTRIBUTE, identity)


def database_key(machine_cls) -> bytes:
    """The key a plain ``run_state_machine_as_test(machine_cls)`` files its examples under."""
    test = _get_state_machine_test(machine_cls, settings=hypothesis.settings(database=None))
    return _function_digest(test.hypothesis.inner_test)


def runnable_program(notes: list[str]) -> str | None:
    """The ``state = ...`` through ``state.teardown()`` lines of Hypothesis's failure report, and
    nothing else: its header ("Falsifying example:", "Failing test case: <state machine>" from
    6.16x on) and trailing notes change between releases and are not Python."""
    lines = "\n".join(notes).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("state = ")), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if lines[i] == "state.teardown()"), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def reproduction_in(notes: list[str]) -> str | None:
    """The ``@reproduce_failure(...)`` line Hypothesis added to a failure's notes, if any."""
    return next(iter(re.findall(r"@reproduce_failure\(.*?\)", "\n".join(notes))), None)
