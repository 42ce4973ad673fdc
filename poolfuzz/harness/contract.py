"""Check a pool family against the interface the harness drives, before fuzzing it.

``check_family(factory, config)`` builds a family the way the engine does, checks that it has every
attribute and method of :class:`poolfuzz.pools.interface.PoolFamilyInterface` (and of its parts),
that its index spaces, components and free lists fit together, that frees are reported to the
listener, and that a short program runs clean on two such families with every check after every
step. A plug-in author runs it in a test; the test suite runs it over every family it has.
"""

from __future__ import annotations

import inspect

import torch

from poolfuzz.errors import ConfigError
from poolfuzz.harness.engine import Engine
from poolfuzz.harness.state_types import state_types_for
from poolfuzz.pools.capabilities import capabilities_of
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.interface import (AllocatorLike, ComponentPool, FreeListLike, KVPoolLike, PoolFamilyInterface,
                                      ReqPoolLike, ServingProtocolLike, TransferLike)
from poolfuzz.pools.request import ReqKv

BACKUP_MODES = ("cpu_tensor", "host_pool")


class ContractViolation(ConfigError):
    """A family lacks something the harness uses, or its parts do not fit together."""


def _missing(obj, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (attributes and methods alike)."""
    return sorted(n for n in _protocol_members(protocol) if not hasattr(obj, n))


def _protocol_members(protocol: type) -> set[str]:
    """The public attributes and methods a Protocol class declares, its bases' included."""
    out = set()
    for klass in protocol.__mro__:
        if klass is object or klass.__module__ == "typing":
            continue
        out.update(n for n in vars(klass) if not n.startswith("_"))
        out.update(n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_"))
    return out


def check_interface(family) -> list[str]:
    """Every way ``family`` misses the interface: missing members of it or of its parts."""
    problems = [f"family lacks {n}" for n in _missing(family, PoolFamilyInterface)]
    try:
        capabilities_of(family)  # a misspelt or mistyped capability: named here, not a silent default
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        return problems
    parts = [("req_pool", family.req_pool, ReqPoolLike), ("kv_pool", family.kv_pool, KVPoolLike),
             ("protocol", family.protocol, ServingProtocolLike)]
    if family.config.has_swa:
        parts.append(("allocator", family.allocator, AllocatorLike))
    if capabilities_of(family).supports_transfer:
        parts.append(("transfer", family.transfer, TransferLike))
    if family.req_pool.mamba_pool is not None:
        parts.append(("req_pool.mamba_pool", family.req_pool.mamba_pool, ComponentPool))
    for space, pool in family.host_pools.items():
        parts.append((f"host_pools[{space!r}]", pool, ComponentPool))
    for space, alloc in family.free_lists().items():
        parts.append((f"free_lists()[{space!r}]", alloc, FreeListLike))
    for where, obj, protocol in parts:
        problems += [f"{where} lacks {n}" for n in _missing(obj, protocol)]
    if not problems and not isinstance(inspect.getattr_static(type(family.kv_pool), "cpu_copy_carries_mamba",
                                                              None), bool):
        problems.append("kv_pool's class does not declare cpu_copy_carries_mamba as a bool class attribute")
    return problems


def check_structure(family) -> list[str]:
    """Do the family's spaces, components and free lists fit together?"""
    problems = []
    lists = family.free_lists()
    if "rows" not in lists:
        problems.append("free_lists() has no 'rows' space")
    try:
        kinds = state_types_for(lists)
    except ValueError as exc:
        return problems + [str(exc)]
    if not any(kind.row_addressed for kind in kinds.values()):
        problems.append("free_lists() has no space that req_to_token addresses ('full', or an all-SWA model's 'swa')")
    if family.backup_mode not in BACKUP_MODES:
        problems.append(f"backup_mode {family.backup_mode!r} is not one of {', '.join(BACKUP_MODES)}")
    comps = list(family.components()) + list(family.host_components())
    for comp in comps:
        if comp.space not in lists:
            problems.append(f"component {comp.name} layer {comp.layer} lives in space {comp.space!r}, "
                            "which free_lists() lacks")
            continue
        if not isinstance(comp.tensor, torch.Tensor) or comp.tensor.dim() < 2:
            problems.append(f"component {comp.name} layer {comp.layer} is not a [slots, ...] tensor")
            continue
        reserved = 1 if kinds[comp.space].reserves_zero else 0
        needed = lists[comp.space].available_size() + reserved
        if comp.num_slots < needed:
            problems.append(f"component {comp.name} layer {comp.layer} has {comp.num_slots} slots, "
                            f"fewer than its free list's {needed}")
    recurrent = any(kinds[c.space].recurrent for c in family.components())
    if recurrent != family.has_recurrent_state():
        problems.append(f"has_recurrent_state() is {family.has_recurrent_state()} but the components say {recurrent}")
    return problems


def check_free_reports(family) -> list[str]:
    """A request admitted, extended and released is reported freed in every space it held."""
    freed: dict[str, int] = {}
    family.set_free_listener(lambda space, slots: freed.__setitem__(space, freed.get(space, 0) + slots.numel()))
    req = ReqKv(rid=1, seqlen=2)
    family.protocol.admit(req, family)
    family.protocol.extend(req, family, 2)
    family.protocol.release_kv(req, family)
    family.set_free_listener(None)
    # A family whose freed units stay readable for its prefix cache (``caches_freed_units``) reports
    # them only when they leave the cache: its full space owes no report here.
    kv = [space for space, kind in state_types_for(family.free_lists()).items() if kind.row_addressed]
    spaces = ("rows",) if capabilities_of(family).caches_freed_units else ("rows", *kv)
    return [f"freeing a request's {space} was not reported to the free listener"
            for space in spaces if not freed.get(space)]


PROGRAM = [("admit", {"prompt_len": 3}), ("prefill", {"rid": 1, "chunk": 3}), ("admit", {"prompt_len": 2}),
           ("prefill", {"rid": 2, "chunk": 2}), ("decode", {"rids": [1, 2]}), ("retract", {"rid": 2}),
           ("resume", {"node": "prefill"}), ("decode", {"rids": [2]}), ("finish", {"rid": 1})]


def check_family(factory, config: ModelConfig, *, device="cpu") -> None:
    """Raise ContractViolation listing every way ``factory``'s family of ``config`` breaks the contract."""
    try:
        family = factory(config, device=device, faults=(), backup_mode=None)
    except Exception as exc:
        raise ContractViolation(f"building the family of {config.name!r} raised {type(exc).__name__}: {exc}") from exc
    problems = check_interface(family)
    if not problems:
        problems = check_structure(family) + check_free_reports(family)
    if not problems:
        try:
            # a family that declines retraction (no server of its engine backs a request's KV up) is not asked to
            program = PROGRAM if capabilities_of(family).supports_retract else [
                (op, args) for op, args in PROGRAM if op not in ("retract", "resume")]
            with Engine(config=config, device=device, family_factory=factory) as engine:
                for op, args in program:
                    getattr(engine, op)(**args)
                    engine.check()
                engine.sweep()
                engine.drain()
        except Exception as exc:
            problems.append(f"the contract program failed: {type(exc).__name__}: {exc}")
    if problems:
        name = getattr(factory, "__qualname__", repr(factory))
        raise ContractViolation(f"family {name} on {config.name!r} breaks the family contract: " + "; ".join(problems))
