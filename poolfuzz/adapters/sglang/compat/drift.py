"""Which errors of a server's build or step are the adapter meeting a reshaped release (API CHANGED), not SGLang
refusing the server, crashing on its own, nor this machine lacking something.

A build the adapter cannot make used to leave the family on its own wiring (deleted at stop 67) with the reason in
``pools_source`` and no run failing: until stop 61, 0.5.16, 0.5.17 and 0.5.19 to 0.5.21 ran every config so, each
lane passing on the adapter's pools instead of SGLang's; today such a build would decline every config. An error is the
adapter's drift where

- a call the adapter makes does not bind (a keyword or field the release dropped: ``TypeError``), a name it imports or
  reads is gone (``ImportError``, ``NameError``), or an attribute it reads is not there (``AttributeError``), raised in
  the SGLang adapter's own code (``poolfuzz/adapters/sglang``);
- SGLang reads an attribute that one of the adapter's stand-ins (a model runner, a model, made without a GPU or
  weights) does not hold: the release reads more of the runner than the stand-in was made with (0.5.21's ``pp_size``);
- SGLang's own seam refuses the platform facts the adapter states (0.5.21's "unknown platform fact(s)");
- the configurator path lacks a name it needs on a release that has the configurator.

Such an error is an ``EngineApiChanged``: the run says "API CHANGED" and names what to update, where a decline would
have left the release untested. A scheduler-path server's build and steps (``drift_checked``; the stand-in
``Scheduler`` made without ``__init__`` is marked) are classified the same way, where the harness would have reported a
crash found in SGLang. Errors SGLang raises from its own code on the server's flags or sizes are not drift: they stay
refusals (``configurator.ServerRefused``) or reasons the family gives."""

from __future__ import annotations

import contextlib
import functools
import os
import types
import weakref

import poolfuzz
from poolfuzz.adapters.sglang.compat.needs import (ENGINE, MODEL_CONFIG_REFUSALS, PRIVATE, STARTUP_REFUSALS,
                                                  release)
from poolfuzz.errors import EngineApiChanged

# the SGLang adapter's own code (not the harness's: a harness bug is no engine's API change)
_ADAPTER_CODE = os.path.join(os.path.dirname(os.path.abspath(poolfuzz.__file__)), "adapters", "sglang") + os.sep
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(poolfuzz.__file__)))
_CALL_DRIFT = (TypeError, ImportError, NameError, AttributeError)


class StandIn(types.SimpleNamespace):
    """An object that holds what SGLang's code reads of one of its own (a model runner made without a GPU, a model
    without weights), named by ``stands_for``: an attribute SGLang reads and it lacks is the adapter's drift, not the
    server's refusal."""

    def __init__(self, stands_for: str, **fields):
        super().__init__(**fields)
        self.__dict__["_stands_for"] = stands_for


_MARKED: weakref.WeakSet = weakref.WeakSet()


def marked_stand_in(obj):
    """``obj``, an instance of SGLang's own class made without its constructor (``object.__new__(ModelRunner)``),
    marked as a stand-in, for the same reason as a ``StandIn``."""
    _MARKED.add(obj)
    return obj


def _is_stand_in(obj) -> bool:
    try:
        return isinstance(obj, StandIn) or obj in _MARKED
    except TypeError:  # unhashable: no marked stand-in
        return False


def _raising_frame(exc: BaseException):
    """The innermost traceback entry of ``exc`` (the frame that raised it), or None."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _raised_in_adapter(exc: BaseException) -> str | None:
    """``file:line (function)`` of the frame that raised ``exc`` where it is the adapter's own code, else None (a call
    that does not bind raises in the caller's frame: the callee's never starts)."""
    tb = _raising_frame(exc)
    if tb is None or not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_ADAPTER_CODE):
        return None
    code = tb.tb_frame.f_code
    return f"{os.path.relpath(code.co_filename, _PACKAGE_PARENT)}:{tb.tb_lineno} ({code.co_name})"


def raised_by_sglang(exc: BaseException) -> bool:
    """Whether SGLang's own code raised ``exc`` (not torch, asked for a device this machine lacks)."""
    import sglang

    tb = _raising_frame(exc)
    package = os.path.dirname(os.path.abspath(sglang.__file__)) + os.sep
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)


def startup_refusal(exc: BaseException) -> str | None:
    """Who refuses a server with ``exc`` raised while its pools are built, in a listing's words, where it is a check
    that no such server starts on any machine: SGLang's own startup checks (``STARTUP_REFUSALS``, by the function
    that raised it, in SGLang's code) or transformers refusing the model's config.json; None otherwise (this
    machine's limit, or a crash)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in MODEL_CONFIG_REFUSALS:
            return MODEL_CONFIG_REFUSALS[cls.__name__]
    tb = _raising_frame(exc)
    if tb is None or not raised_by_sglang(exc):
        return None
    who, words = STARTUP_REFUSALS.get(tb.tb_frame.f_code.co_name, (None, None))
    return who if who is not None and (words is None or words in str(exc)) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _stand_in_name(obj) -> str:
    return obj._stands_for if isinstance(obj, StandIn) else type(obj).__name__


def build_drift(exc: BaseException, *, during: str) -> EngineApiChanged | None:
    """The EngineApiChanged that ``exc``, raised ``during`` a server's build or step (in a listing's words), is where
    it is the adapter's drift (module docstring), else None."""
    if not isinstance(exc, _CALL_DRIFT):
        return None
    stand_in = isinstance(exc, AttributeError) and _is_stand_in(getattr(exc, "obj", None))
    where = _raised_in_adapter(exc)
    if not stand_in and where is None:
        return None  # raised by SGLang's (or a library's) own code: what it says of the server, not the adapter's call
    attribute = (f"what {during} reads of the adapter's stand-in {_stand_in_name(exc.obj)}" if stand_in
                 else f"the adapter's call at {where}, in {during}")
    expected = ("the fields the adapter's stand-in holds (the release reads another)" if stand_in
                else "the names, keywords and fields the adapter passes and reads")
    return EngineApiChanged(engine=ENGINE, release=release(), attribute=attribute, expected=expected,
                            found=_first_line(exc))


def platform_refused(exc: BaseException, facts) -> EngineApiChanged:
    """SGLang's ``override_platform`` refused the platform facts the adapter states (``facts``, their names)."""
    return EngineApiChanged(engine=ENGINE, release=release(), attribute=PRIVATE["override_platform"].target,
                            expected=f"to take the platform facts the adapter states ({', '.join(sorted(facts))})",
                            found=_first_line(exc))


def configurator_lacking(missing) -> EngineApiChanged:
    """A release with SGLang's KV cache configurator lacks ``missing``, names its configurator path calls."""
    first = PRIVATE[missing[0]].target
    return EngineApiChanged(engine=ENGINE, release=release(), attribute=first,
                            expected="present beside KVCacheConfigurator (the configurator path calls it)",
                            found=f"absent ({', '.join(missing)} lacking)")


@contextlib.contextmanager
def drift_raised(during: str):
    """Runs its block; an error of it that is the adapter's drift (``build_drift``) is raised as API CHANGED, any
    other as it was."""
    try:
        yield
    except _CALL_DRIFT as exc:
        if (change := build_drift(exc, during=during)) is not None:
            raise change from exc
        raise


def drift_checked(cls, methods: tuple[str, ...]):
    """``cls`` with each of ``methods`` that it defines itself re-raising the adapter's drift as API CHANGED, not as a
    crash the harness would report as found in SGLang (a step of a server whose release reads a field its stand-in
    Scheduler lacks, or a call the adapter makes in a step that no longer binds)."""
    for name in methods:
        method = vars(cls).get(name)
        if callable(method) and not getattr(method, "drift_checked", False):
            setattr(cls, name, _checked(method, name))
    return cls


def _checked(method, name: str):
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        with drift_raised(f"{self.label}'s {name}"):
            return method(self, *args, **kwargs)

    checked.drift_checked = True
    return checked
