"""What a pool family and its factory can do, as typed records read once (``capabilities_of``).

A family declares its capabilities as attributes (``supports_fork = False``, a ``flush_cache`` method,
...), documented in :mod:`poolfuzz.pools.interface`; the harness never asks for one by name with a
default. It reads them all here, once per family it builds, into a frozen :class:`Capabilities`: a
misspelt one (``suports_fork``), one of the wrong type, or an unknown ``supports_*`` name is a
ConfigError naming it when the family is built, not a silent default. A factory's own attributes
(``unsupported_reason``, ``builds_per_node``, ...) are :class:`FactoryCapabilities`, read by
``factory_capabilities`` the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from poolfuzz.errors import ConfigError


# Who built the pools an example runs on: poolfuzz's own model of them (the built-in family), the engine's own code
# for the config's server (its KV cache configurator, or the runner of a release without one), or the adapter
# wiring the engine's pool classes itself (a restatement of that code, which the engine's bugs in it do not reach).
POOLS_BUILDERS = ("poolfuzz", "engine", "adapter")


@dataclass(frozen=True, kw_only=True)
class PoolsOrigin:
    """Who built a family's pools (one of ``POOLS_BUILDERS``) and, in words, how: the server flags the engine built
    them for, or why the adapter wired them. A run counts its examples by it; an artifact records it."""

    built_by: str
    detail: str

    def __post_init__(self):
        if self.built_by not in POOLS_BUILDERS:
            raise ConfigError(f"PoolsOrigin.built_by must be one of {', '.join(POOLS_BUILDERS)}, got {self.built_by!r}")

    def to_json(self) -> dict:
        return {"built_by": self.built_by, "detail": self.detail}


def nodes_pools_origin(by_node: dict[str, PoolsOrigin | None]) -> PoolsOrigin | None:
    """The origin of an example's pools over its nodes (node -> its family's): the engine's only where every node's
    is, else the first node's that is not, named; None where a node's family does not say."""
    origins = list(by_node.values())
    if not origins or any(o is None for o in origins):
        return None
    if len(set(origins)) == 1:
        return origins[0]
    node, origin = next(((n, o) for n, o in by_node.items() if o.built_by != "engine"), next(iter(by_node.items())))
    return PoolsOrigin(built_by=origin.built_by, detail=f"{node} node: {origin.detail}")


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """A family's capabilities (each field's default is what a family that does not declare it gets)."""

    # Operations the state machine may run on it (False: the rule is skipped).
    supports_fork: bool = True
    supports_transfer: bool = True
    supports_retract: bool = True
    supports_speculative: bool = True
    supports_next_turn: bool = False  # finished requests' tokens are kept for a chat's next turn
    supports_tree_drafts: bool = False  # speculative verify over a draft tree (protocol.move_accepted)
    # How it counts and pads.
    prefix_caching: bool = False  # a resume asks protocol.lookup what the prefix cache found
    resume_swa_tail_only: bool = True  # a paged SWA resume gives slots to the window's tail only
    pads_slot_zero: bool = True  # False: a padded batch writes nowhere (vLLM pads with -1)
    caches_freed_units: bool = False  # freed units keep their contents (reported free when they leave the cache)
    shared_unit_spaces: tuple[str, ...] = ()  # spaces whose units come from one pool
    reference_factory: Callable | None = None  # the reference model of its accounting (None: ReferenceFamily)
    pools_origin: PoolsOrigin | None = None  # who built its pools (None: the family does not say)
    # Optional methods of the family (None: it has none), bound.
    cached_units: Callable | None = None
    flush_prefix_cache: Callable | None = None
    flush_cache: Callable | None = None
    idle_problem: Callable | None = None
    close: Callable | None = None
    take_stored_pages: Callable | None = None
    # Optional doors of its parts (see pools/interface.py).
    kv_writes_through_engine: bool = False  # kv_pool.writes_through_engine
    kv_write_verified_rows: Callable | None = None  # kv_pool.write_verified_rows
    spec_scratch: Any = None  # req_pool.mamba_pool.spec_scratch
    get_track_slots: Callable | None = None  # req_pool.get_track_slots
    after_prefill: Callable | None = None  # protocol.after_prefill
    finish: Callable | None = None  # protocol.finish


_FLAGS = {f.name: f for f in dataclasses.fields(Capabilities)}
# Where each door lives: (part of the family, its attribute name there).
_DOORS = {"kv_writes_through_engine": ("kv_pool", "writes_through_engine"),
          "kv_write_verified_rows": ("kv_pool", "write_verified_rows"),
          "spec_scratch": ("req_pool.mamba_pool", "spec_scratch"),
          "get_track_slots": ("req_pool", "get_track_slots"),
          "after_prefill": ("protocol", "after_prefill"),
          "finish": ("protocol", "finish")}
_NO_PART = object()


def _part(family, path: str):
    """The part of ``family`` a dotted path names (``req_pool.mamba_pool``), or the sentinel where there is none."""
    obj = family
    for name in path.split("."):
        obj = _declared(obj, name)
        if obj is _NO_PART or obj is None:
            return _NO_PART
    return obj


def _declared(obj, name: str):
    """``obj``'s attribute ``name`` where it declares one (class or instance), else the sentinel."""
    try:
        return getattr(obj, name)
    except AttributeError:
        return _NO_PART


def _check(owner: str, name: str, value, kind):
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be True or False, got {value!r}")
    if name == "pools_origin" and not isinstance(value, PoolsOrigin):
        raise ConfigError(f"{owner}.pools_origin must be a PoolsOrigin (poolfuzz.pools.capabilities), got {value!r}")
    if name == "shared_unit_spaces" and not (isinstance(value, tuple) and all(isinstance(s, str) for s in value)):
        raise ConfigError(f"{owner}.shared_unit_spaces must be a tuple of space names, got {value!r}")
    return value


def capabilities_of(family) -> Capabilities:
    """Every capability ``family`` declares, checked: an unknown ``supports_*`` name (a misspelling) or a
    flag of the wrong type is a ConfigError naming it."""
    owner = type(family).__name__
    unknown = sorted(n for n in dir(family) if n.startswith("supports_") and n not in _FLAGS)
    if unknown:
        known = ", ".join(n for n in _FLAGS if n.startswith("supports_"))
        raise ConfigError(f"{owner} declares {', '.join(unknown)}, which is no capability (known: {known}); "
                          "see poolfuzz/pools/capabilities.py")
    found: dict = {}
    for name, f in _FLAGS.items():
        if name in _DOORS:
            path, attr = _DOORS[name]
            part = _part(family, path)
            value = _NO_PART if part is _NO_PART else _declared(part, attr)
        else:
            value = _declared(family, name)
        if value is _NO_PART or (value is None and f.default is None):
            continue
        kind = bool if isinstance(f.default, bool) else None
        found[name] = _check(owner, name, value, kind)
    return Capabilities(**found)


@dataclass(frozen=True, kw_only=True)
class ServerDescription:
    """What a config stands for on an engine (``poolfuzz configs --family``): the server flags, and the pools the
    engine's own configurator built for that server on this machine, beside those the family builds for it. A flag
    whose value is the server's own model path (a draft model that lives in the target's checkpoint) reads
    ``MODEL_PATH`` in ``flags``."""

    flags: str  # the server's command-line flags ("" where no server stands for the config yet)
    built: dict[str, str] | None  # part -> its class and size, as the engine's configurator built it; None: refused
    refused: str | None  # why the engine (here) refuses that server, or why no server stands for the config yet
    family: dict[str, str] | None  # part -> its class and size, as the family builds it; None: the family declines
    family_declines: str | None = None  # why the family declines the config
    # what the engine raised starting the family's server (a startup crash: ``poolfuzz run`` reports it as a failure)
    family_crashes: str | None = None
    model: dict | None = None  # the model's config.json the server reads (None: no model stands for the config yet)
    launcher: str = ""  # the engine's own launch command for that server, without its model path and flags
    notes: tuple[str, ...] = ()  # what else a reader of the listing must know (a flag added after a refusal)
    # parts of ``built`` no family runs on (a speculative server's draft KV pool): listed, not compared
    unfuzzed: tuple[str, ...] = ()
    built_by: str = "configurator"  # what in the engine built ``built`` (a release without a configurator: its runner)
    # the variables the server is started with, as a shell prefixes them (``NAME=value ...``; its pools are sized in
    # them): "" where it needs none
    environment: str = ""

    def command(self, model_path: str) -> str:
        """The command that launches the server on the model at ``model_path`` (already quoted for a shell)."""
        launch = f"{self.launcher} --model-path {model_path} {self.flags.replace(MODEL_PATH, model_path)}"
        return f"{self.environment} {launch}" if self.environment else launch


# A server flag's value that stands for the server's own model path (its listing prints it so).
MODEL_PATH = "<model-path>"


@dataclass(frozen=True, kw_only=True)
class FactoryCapabilities:
    """What a family factory declares beside building families (attributes of the factory function)."""

    unsupported_reason: Callable | None = None  # (config) -> str | None: the configs it declines, and why
    # True: its unsupported_reason also takes the run's ``backup_mode=`` (None: unnamed), where what it declines
    # depends on it (a server that resolves its own backup refuses a config with one it would not with another)
    declines_by_backup_mode: bool = False
    builds_per_node: bool = False  # the engine tells it the node each family serves (node="prefill"/"decode")
    supports_next_turn: bool = False  # its families may continue finished requests: the machine gets the rule
    engine_code: tuple[str, ...] | None = None  # what --coverage measures, relative to the engine's parent dir
    engine_report: Callable | None = None  # () -> engine_api.EngineReport: what doctor prints, run checks
    # True: the factory builds a *scheduler driver* (harness/scheduled.py), not a pool family: a run drives the
    # engine's own scheduler with the ScheduledMachine instead of playing the scheduler with the Engine machine.
    drives_scheduler: bool = False
    # True: a scheduler driver's factory that builds servers for drawn configs too (``--config random``: each example
    # draws its own, filtered by its unsupported_reason; what its server refuses at startup, a ConfigError, is declined)
    takes_drawn_configs: bool = False
    # (config) -> ServerDescription: the server a config stands for and the pools the engine's configurator builds
    # for it (``poolfuzz configs --family``)
    describe_server: Callable | None = None
    # (drawn config) -> the config as the model its engine serves for that kind of layers has them (their layout,
    # their state's widths), or the config as drawn: applied to every drawn config before unsupported_reason, so that
    # draws are steered to models a server runs rather than declined
    model_shaped: Callable | None = None

    def decline_reason(self, config, *, backup_mode: str | None = None) -> str | None:
        """Why the factory declines ``config`` for a run that names ``backup_mode`` (where its declines depend on
        it), or None."""
        if self.unsupported_reason is None:
            return None
        if self.declines_by_backup_mode:
            return self.unsupported_reason(config, backup_mode=backup_mode)
        return self.unsupported_reason(config)


_FACTORY_FLAGS = {f.name: f for f in dataclasses.fields(FactoryCapabilities)}


def factory_capabilities(factory) -> FactoryCapabilities:
    """The factory's declared capabilities; an attribute on the factory function that is none of them
    (a misspelling such as ``unsuported_reason``) is a ConfigError naming it."""
    if factory is None:
        return FactoryCapabilities()
    owner = getattr(factory, "__qualname__", type(factory).__name__)
    own = vars(factory) if hasattr(factory, "__dict__") else {}
    unknown = sorted(n for n in own if not n.startswith("_") and n not in _FACTORY_FLAGS)
    if unknown and callable(factory) and not isinstance(factory, type):
        raise ConfigError(f"family factory {owner} declares {', '.join(unknown)}, which is no factory capability "
                          f"(known: {', '.join(_FACTORY_FLAGS)}); see poolfuzz/pools/capabilities.py")
    found = {}
    for name, f in _FACTORY_FLAGS.items():
        value = _declared(factory, name)
        if value is _NO_PART or value is None:
            continue
        found[name] = _check(owner, name, value, bool if isinstance(f.default, bool) else None)
    return FactoryCapabilities(**found)
