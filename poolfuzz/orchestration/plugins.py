"""Pool-family plug-ins: which factory builds the families the harness drives.

A *family factory* is a callable ``factory(config, *, device, faults, backup_mode)`` that
returns an object used exactly like :class:`poolfuzz.pools.family.PoolFamily` (see the
README section "Pointing poolfuzz at your own pools"). ``--family`` selects one:

* ``builtin`` (the default): poolfuzz's own pools, :func:`poolfuzz.pools.family.build_family`;
* a name registered in the entry-point group ``poolfuzz.families`` by an installed package,
  e.g. ``sglang:scheduler`` (this package registers it for :mod:`poolfuzz.adapters.sglang`);
* a *suite* (``SUITES``): a name for several families at once. ``--family sglang`` fuzzes every
  config through each of SGLang's servers that runs it (the plain server, the HiCache server, the PD
  decode server), each (family, config) its own lane; a question only one family can answer (replay,
  hunt, bench) asks for one of them by name;
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

from poolfuzz.errors import api_change_in
from poolfuzz.pools.capabilities import factory_capabilities
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

ENTRY_POINT_GROUP = "poolfuzz.families"
DEFAULT_FAMILY = "builtin"

# Names poolfuzz ships, resolved even where the installed metadata is stale (an editable
# install made before an entry point was added). Installed plug-ins cannot shadow them.
SHIPPED = {
    "builtin": "poolfuzz.pools.family:build_family",
    "sglang:scheduler": "poolfuzz.adapters.sglang:build_scheduler_driver",
    "sglang:decode": "poolfuzz.adapters.sglang:build_decode_driver",
    "sglang:hicache": "poolfuzz.adapters.sglang:build_hicache_driver",
    "sglang:unified-server": "poolfuzz.adapters.sglang:build_unified_server",
    "sglang:unified-decode": "poolfuzz.adapters.sglang:build_unified_decode",
    "vllm": "poolfuzz.adapters.vllm:build_scheduler_driver",
    "vllm:scheduler": "poolfuzz.adapters.vllm:build_scheduler_driver",  # its name for one release: artifacts say it
    "vllm:manager": "poolfuzz.adapters.vllm:build_manager_family",
}
SHIPPED_ORIGIN = "shipped"  # a FamilyPlugin's origin for the families above: poolfuzz's own code, trusted
# Families whose engine-operation programs now replay under another name: ``vllm`` drove vLLM's manager directly
# (the harness playing the scheduler) until it ran vLLM's own Scheduler; that path is ``vllm:manager``. ``sglang``
# drove SGLang's pools with the adapter's admission until it ran SGLang's own servers; that path was ``sglang:pools``,
# retired since (below), so such a program says so.
ENGINE_PROGRAMS_OF = {"vllm": "vllm:manager", "sglang": "sglang:pools"}
# Families deleted once the engine's own code drove their path: the name, and what runs that path now.
RETIRED = {"sglang:unified": "sglang:unified-server or sglang:unified-decode (SGLang's own scheduler on the unified "
                             "memory pool, where the pools path restated its admission)",
           "sglang:pools": "sglang (SGLang's own servers: sglang:scheduler, sglang:hicache, sglang:decode and the unified "
                           "ones, where the pools path restated SGLang's admission, frees and retraction)"}
# Names for several families at once, in the order their lanes run: each member fuzzes the configs it drives.
# ``sglang``: every server SGLang's own scheduler runs here.
SUITES = {"sglang": ("sglang:scheduler", "sglang:hicache", "sglang:decode", "sglang:unified-server",
                    "sglang:unified-decode")}


@dataclass(frozen=True, kw_only=True)
class FamilyPlugin:
    """A resolved ``--family``: its name as given, where it came from, and the factory."""

    name: str
    target: str  # "module:attr"
    origin: str  # "shipped", "entry point (<distribution>)" or "module path"
    factory: Callable

    def __repr__(self) -> str:
        return f"FamilyPlugin({self.name} -> {self.target}, {self.origin})"

    def unsupported_reason(self, config: ModelConfig, *, backup_mode: str | None = None) -> str | None:
        """Why the family declines ``config`` (for a run that names ``backup_mode``, where the factory's declines
        depend on it), or None."""
        return factory_capabilities(self.factory).decline_reason(config, backup_mode=backup_mode)

    @property
    def takes_drawn_configs(self) -> bool:
        """A scheduler driver's factory that also builds servers for drawn configs (``run`` asks it only of those: the
        pool families always take drawn configs)."""
        return factory_capabilities(self.factory).takes_drawn_configs

    @property
    def drives_scheduler(self) -> bool:
        """The factory builds a driver of the engine's own scheduler (harness/scheduled.py), not a pool family."""
        return factory_capabilities(self.factory).drives_scheduler

    def describe_server(self, config: ModelConfig):
        """The server ``config`` stands for on this family's engine (a ``ServerDescription``), or None for a family
        that describes none."""
        describe = factory_capabilities(self.factory).describe_server
        return None if describe is None else describe(config)

    def engine_report(self):
        """The factory's ``engine_report()`` (an ``adapters.engine_api.EngineReport``: the engine release
        and every entry point the family needs, probed), or None for a family over no external engine."""
        probe = factory_capabilities(self.factory).engine_report
        return None if probe is None else probe()

    def check_engine(self) -> None:
        """Raise the EngineApiChanged of the first entry point the installed engine lacks, if any."""
        report = self.engine_report()
        if report is not None and report.change is not None:
            raise report.change


def installed_families() -> dict[str, str]:
    """Every family name that resolves here: shipped ones, the suites (as ``suite(a, b)``), then the entry-point
    group."""
    out = dict(SHIPPED) | {name: f"suite({', '.join(members)})" for name, members in SUITES.items()}
    for ep in _entry_points():
        if ep.name not in RETIRED:  # an install older than its retirement still lists it
            out.setdefault(ep.name, ep.value)
    return out


def _entry_points():
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def family_members(spec: str | None) -> tuple[str, ...]:
    """The families ``spec`` names: a suite's members, or ``spec`` alone (the default family where None)."""
    name = spec or DEFAULT_FAMILY
    return SUITES.get(name, (name,))


def resolve_members(spec: str | None) -> tuple[FamilyPlugin, ...]:
    """The plug-in of every family ``spec`` names (one, or a suite's members), each resolved as ``resolve_family``."""
    return tuple(resolve_family(name) for name in family_members(spec))


def resolve_family(spec: str | None) -> FamilyPlugin:
    """The plug-in ``spec`` names; a ConfigError that says what to do when it cannot load, or when ``spec`` is a
    suite (several families: the caller needs one)."""
    name = spec or DEFAULT_FAMILY
    if name in SUITES:
        raise ConfigError(f"{name!r} names several families ({', '.join(SUITES[name])}), and this needs one: "
                          f"name one of them, e.g. --family {SUITES[name][0]}")
    if name in RETIRED:
        raise ConfigError(f"the family {name!r} was retired; its path now runs as --family {RETIRED[name]}")
    if name in SHIPPED:  # first: a shipped variant's name ("sglang:decode") is no module path
        return FamilyPlugin(name=name, target=SHIPPED[name], origin=SHIPPED_ORIGIN, factory=_load(SHIPPED[name], name))
    if ":" in name:
        return FamilyPlugin(name=name, target=name, origin="module path", factory=_load(name, name))
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


def resolve_recorded(spec: str, *, trusted: str | None = None) -> FamilyPlugin:
    """The family a file (an artifact) names, resolved only if it cannot choose what code runs.

    A file is untrusted input: ``module:attr`` in it would import and call anything (``this:s``
    prints the Zen of Python). So only the shipped names and installed plug-ins (the entry-point
    group) resolve on their own; any other name must equal ``trusted``, the ``--family`` the user
    typed. Names are checked before anything is imported. A ConfigError says what to pass.
    """
    if spec in RETIRED:
        raise ConfigError(f"recorded on pool family {spec!r}, which was retired: its path now runs as --family "
                          f"{RETIRED[spec]}; fuzz that family to find the failure again")
    if trusted is not None and spec != trusted:
        raise ConfigError(f"recorded on pool family {spec!r}, but --family names {trusted!r}; pass "
                          f"--family {spec} to trust the family it was recorded on")
    if spec != trusted and spec not in SHIPPED and (":" in spec or spec not in installed_families()):
        raise ConfigError(f"recorded on pool family {spec!r}, which does not load here: it is not installed as a "
                          f"plug-in (installed: {', '.join(installed_families())}); a file never chooses code to "
                          f"run, so if you trust {spec!r}, pass --family {spec}")
    return resolve_family(spec)


# What the harness calls on every family; a factory whose result lacks these is not a family factory.
FAMILY_SURFACE = ("backup_mode", "components", "free_lists", "protocol", "req_pool")
# What the ScheduledMachine calls on the driver a factory that ``drives_scheduler`` builds.
DRIVER_SURFACE = ("add_request", "step", "abort", "live", "propose_drafts", "state_problem", "drain", "close",
                  "streaming_sessions", "flushes")


def probe_family(plugin: FamilyPlugin, config: ModelConfig, *, device="cpu", faults=(),
                 backup_mode: str | None = None) -> None:
    """Build one family with the factory; a ConfigError naming the factory if it raises or returns
    something without the family surface. What a factory does wrong is bad usage, not a found bug; a shipped
    family's build that raises is the engine's startup crash (SGLang 0.5.12's FP4 decode server, 0.5.15's all-SWA
    HiCache server): the run fuzzes the config and each example reports the crash as found, and a replay of its
    artifact reproduces it, where before both stopped at this probe blaming the factory."""
    try:
        family = plugin.factory(config, device=device, faults=tuple(faults), backup_mode=backup_mode)
    except Exception as exc:
        if api_change_in(exc) is not None:  # the engine's API, not the factory: its own verdict
            raise api_change_in(exc) from None
        if plugin.origin == SHIPPED_ORIGIN and not isinstance(exc, ConfigError):
            return
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"family {plugin.name!r} ({plugin.target}) cannot build config {config.name!r} on "
                          f"{device}: {type(exc).__name__}{': ' + reason if reason else ''}; pass a factory "
                          f"factory(config, *, device, faults, backup_mode) that returns a pool family") from None
    drives_scheduler = plugin.drives_scheduler
    missing = [a for a in (DRIVER_SURFACE if drives_scheduler else FAMILY_SURFACE) if not hasattr(family, a)]
    if missing and drives_scheduler:
        raise ConfigError(f"family {plugin.name!r} ({plugin.target}) declares drives_scheduler but returned a "
                          f"{type(family).__name__}, not a scheduler driver (it lacks {', '.join(missing)}); see "
                          "poolfuzz/harness/scheduled.py")
    if missing:
        raise ConfigError(f"family {plugin.name!r} ({plugin.target}) returned a {type(family).__name__}, not a pool "
                          f"family (it lacks {', '.join(missing)}); pass a factory that returns one (see the README "
                          "section 'Pointing poolfuzz at your own pools')")


def select_configs(plugin: FamilyPlugin, configs: Iterable[ModelConfig], *, explicit: bool,
                   backup_mode: str | None = None) -> tuple[list[ModelConfig], list[tuple[str, str]]]:
    """(configs to run, [(skipped config, reason)]) for a run naming ``backup_mode`` (None: unnamed). A declined
    explicit config is an error."""
    chosen, skipped = [], []
    for config in configs:
        reason = plugin.unsupported_reason(config, backup_mode=backup_mode)
        if reason is None:
            chosen.append(config)
        elif explicit:
            raise ConfigError(f"family {plugin.name!r} does not support config {config.name!r}: {reason}")
        else:
            skipped.append((config.name, reason))
    return chosen, skipped
