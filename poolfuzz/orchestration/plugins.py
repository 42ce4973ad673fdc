"""Pool-family plug-ins: which factory builds the families the harness drives.

A *family factory* is a callable ``factory(config, *, device, faults, backup_mode)`` that
returns an object used exactly like :class:`poolfuzz.pools.family.PoolFamily` (see the
README section "Pointing poolfuzz at your own pools"). ``--family`` selects one:

* ``builtin`` (the default): poolfuzz's own pools, :func:`poolfuzz.pools.family.build_family`;
* a name registered in the entry-point group ``poolfuzz.families`` by an installed package,
  e.g. ``sglang`` (this package registers it for :mod:`poolfuzz.adapters.sglang`);
* ``package.module:factory`` (dotted attributes allowed after the colon) for a factory that
  is importable but not installed as a plug-in.

A factory may also carry ``unsupported_reason(config) -> str | None``: ``poolfuzz run``
skips the configs it declines (saying why) instead of failing on them, and a config named
explicitly with ``--config`` that it declines is a usage error carrying that reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Iterable

from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

ENTRY_POINT_GROUP = "poolfuzz.families"
DEFAULT_FAMILY = "builtin"

# Names poolfuzz ships, resolved even where the installed metadata is stale (an editable
# install made before an entry point was added). Installed plug-ins cannot shadow them.
SHIPPED = {
    "builtin": "poolfuzz.pools.family:build_family",
    "sglang": "poolfuzz.adapters.sglang:build_family",
}


@dataclass(frozen=True, kw_only=True)
class FamilyPlugin:
    """A resolved ``--family``: its name as given, where it came from, and the factory."""

    name: str
    target: str  # "module:attr"
    origin: str  # "shipped", "entry point (<distribution>)" or "module path"
    factory: Callable

    def __repr__(self) -> str:
        return f"FamilyPlugin({self.name} -> {self.target}, {self.origin})"

    def unsupported_reason(self, config: ModelConfig) -> str | None:
        probe = getattr(self.factory, "unsupported_reason", None)
        return None if probe is None else probe(config)


def installed_families() -> dict[str, str]:
    """Every family name that resolves here: shipped ones, then the entry-point group."""
    out = dict(SHIPPED)
    for ep in _entry_points():
        out.setdefault(ep.name, ep.value)
    return out


def _entry_points():
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def resolve_family(spec: str | None) -> FamilyPlugin:
    """The plug-in ``spec`` names; a ConfigError that says what to do when it cannot load."""
    name = spec or DEFAULT_FAMILY
    if ":" in name:
        return FamilyPlugin(name=name, target=name, origin="module path", factory=_load(name, name))
    if name in SHIPPED:
        return FamilyPlugin(name=name, target=SHIPPED[name], origin="shipped", factory=_load(SHIPPED[name], name))
    for ep in _entry_points():
        if ep.name == name:
            dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
            return FamilyPlugin(name=name, target=ep.value, origin=f"entry point ({dist})",
                                factory=_load(ep.value, name))
    raise ConfigError(
        f"unknown pool family {name!r}; installed families: {', '.join(installed_families())}. "
        f"Give package.module:factory, or install a package that registers {name!r} in the "
        f"{ENTRY_POINT_GROUP!r} entry-point group"
    )


def _load(target: str, name: str) -> Callable:
    module_name, _, attr_path = target.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"family {name!r}: {target!r} is not of the form package.module:factory")
    try:
        obj = importlib.import_module(module_name)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"family {name!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"family {name!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ConfigError(f"family {name!r}: {target} is a {type(obj).__name__}, not a callable factory")
    return obj


def select_configs(plugin: FamilyPlugin, configs: Iterable[ModelConfig], *,
                   explicit: bool) -> tuple[list[ModelConfig], list[tuple[str, str]]]:
    """(configs to run, [(skipped config, reason)]). A declined explicit config is an error."""
    chosen, skipped = [], []
    for config in configs:
        reason = plugin.unsupported_reason(config)
        if reason is None:
            chosen.append(config)
        elif explicit:
            raise ConfigError(f"family {plugin.name!r} does not support config {config.name!r}: {reason}")
        else:
            skipped.append((config.name, reason))
    return chosen, skipped
