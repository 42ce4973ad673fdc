"""Checked reads of an engine's API: each probe says present, absent or changed, and what it expected.

The per-engine compatibility modules (``adapters/vllm/compat.py``, ``adapters/sglang/compat/``) state
what their family needs of the installed release as :class:`Need` records; :func:`probe` checks one
against the release and :func:`require` turns a needed one that is not there into an
:class:`~poolfuzz.errors.EngineApiChanged` naming the release, the name and what was expected.
``poolfuzz doctor`` prints the same probes; ``poolfuzz run`` refuses early on them.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

from poolfuzz.errors import EngineApiChanged

PRESENT, ABSENT, CHANGED = "present", "absent", "changed"


@dataclass(frozen=True, kw_only=True)
class Need:
    """One thing a family uses of an engine: ``module:attr.attr`` and, for a callable, the parameters
    it must take. ``required`` False: a feature the family probes and does without (``absent`` then
    only narrows which configs run); ``used_for`` says what it serves, for the doctor's listing."""

    target: str  # "package.module:Class.method"
    also: tuple[str, ...] = ()  # where other releases keep it, tried in turn after ``target``
    params: tuple[str, ...] = ()  # parameter names a callable must accept
    fields: tuple[str, ...] = ()  # dataclass / msgspec struct fields a class must have
    required: bool = True
    used_for: str = ""

    @property
    def label(self) -> str:
        """The target, with the fields it is probed for: two needs of one class read apart."""
        return f"{self.target} [{', '.join(self.fields)}]" if self.fields else self.target

    @property
    def expected(self) -> str:
        parts = []
        if self.params:
            parts.append(f"a callable taking {', '.join(self.params)}")
        if self.fields:
            parts.append(f"fields {', '.join(self.fields)}")
        return " with ".join(parts) if parts else "present"


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What :func:`probe` found for one :class:`Need`."""

    need: Need
    status: str  # present | absent | changed
    found: str  # what is there instead ("no such attribute", "takes (self, x)", ...), or where it was found
    value: Any = None  # what the need resolved to, when present

    @property
    def ok(self) -> bool:
        return self.status == PRESENT or not self.need.required

    def change(self, *, engine: str, release: str) -> EngineApiChanged:
        """What a run stops with when this need is not there (or not as expected)."""
        return EngineApiChanged(engine=engine, release=release, attribute=self.need.target,
                                expected=self.need.expected, found=self.found)


def resolve(target: str) -> Any:
    """The object ``module:attr.attr`` names; AttributeError/ImportError when it is not there. An engine's
    import chain may warn about its own use of other libraries: not a probe's to fail on."""
    module_name, _, path = target.partition(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = importlib.import_module(module_name)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _field_names(cls) -> set[str]:
    names = set(getattr(cls, "__struct_fields__", ()))  # msgspec structs
    names |= set(getattr(cls, "__dataclass_fields__", {}))
    names |= set(getattr(cls, "model_fields", {}) or {})  # pydantic
    return names


def probe(need: Need) -> Probe:
    tried = []  # why each place failed; with alternatives, each names its place
    for target in (need.target, *need.also):
        try:
            obj = resolve(target)
            break
        except ImportError as exc:
            why = f"cannot import ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            tried.append(f"{target.partition(':')[0]}: {why}" if need.also else why)
        except AttributeError:
            tried.append(f"no {target}" if need.also else "no such attribute")
    else:
        return Probe(need=need, status=ABSENT, found="; ".join(tried))
    if need.params:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return Probe(need=need, status=CHANGED, found=f"a {type(obj).__name__} with no signature")
        missing = [p for p in need.params if p not in params]
        if missing:
            return Probe(need=need, status=CHANGED,
                         found=f"takes ({', '.join(params)}), without {', '.join(missing)}")
    if need.fields:
        missing = [f for f in need.fields if f not in _field_names(obj)]
        if missing:
            return Probe(need=need, status=CHANGED, found=f"has no field {', '.join(missing)}")
    return Probe(need=need, status=PRESENT, found=target if need.also else "present", value=obj)


def require(needs, *, engine: str, release: str) -> list[Probe]:
    """Every probe of ``needs``; the first needed one not present raises EngineApiChanged."""
    found = report(needs, engine=engine, release=release)
    if found.change is not None:
        raise found.change
    return list(found.probes)


def checked_attr(obj: Any, name: str, *, engine: str, release: str, expected: str, owner: str | None = None) -> Any:
    """``getattr(obj, name)`` where the engine must have it: EngineApiChanged naming it when not."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise EngineApiChanged(engine=engine, release=release, attribute=f"{owner or type(obj).__name__}.{name}",
                               expected=expected, found="no such attribute") from None


@dataclass(frozen=True, kw_only=True)
class EngineReport:
    """What ``poolfuzz doctor`` prints for a family's engine: its release and every probe."""

    engine: str
    release: str
    probes: tuple[Probe, ...]

    @property
    def change(self) -> EngineApiChanged | None:
        """The first needed probe that is not present, as the error a run stops with; None if all are."""
        missing = next((p for p in self.probes if not p.ok), None)
        return None if missing is None else missing.change(engine=self.engine, release=self.release)


def report(needs, *, engine: str, release: str) -> EngineReport:
    return EngineReport(engine=engine, release=release, probes=tuple(probe(n) for n in needs))
