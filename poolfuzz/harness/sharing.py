"""The audit of a pool whose index spaces draw units from one pool (vLLM's KV cache groups).

Enabled by the family capability ``shared_unit_spaces`` (the spaces that share one pool): a unit (a block) may sit in one space's
tables only, however each space looks alone (vLLM #44409: one group's allocation took another
group's prefix-hit block, so one physical block held two layers' KV). Where the space's free list
tells a unit's ``ref_count``, it must equal the number of tables that hold the unit.
"""

from __future__ import annotations

from poolfuzz.harness.records import Phase


def audit_shared_units(engine, node: str, fam, held_by: dict[str, list[tuple[int, int]]], invariant) -> None:
    """``held_by``: per space, (unit, rid) of every unit a live request's table holds."""
    lists = fam.free_lists()
    first: dict[int, tuple[str, int]] = {}  # unit -> (space, rid) of its first holder
    holders: dict[int, int] = {}
    for space, units in held_by.items():
        for unit, rid in units:
            holders[unit] = holders.get(unit, 0) + 1
            seen = first.setdefault(unit, (space, rid))
            if seen[0] != space:
                other_space, other_rid = seen
                invariant("shared-unit",
                          f"{_describe(lists[space], unit)} sits in two KV cache groups: {other_space} "
                          f"(req {other_rid}) and {space} (req {rid}); both groups' layers write its bytes",
                          node, space=space, slot=unit)
    for unit, n in holders.items():
        space = first[unit][0]
        count = getattr(lists[space], "ref_count", None)
        if count is not None and count(unit) != n:
            invariant("shared-unit", f"{_describe(lists[space], unit)} is held by {n} table(s) but its ref count "
                      f"is {count(unit)}", node, space=space, slot=unit)


def _describe(free_list, unit: int) -> str:
    describe = getattr(free_list, "describe_unit", None)
    return describe(unit) if describe is not None else f"unit {unit}"


def audit_protected_prefixes(engine, node: str, fam, cached: dict[str, list[int]]) -> list:
    """(rid, space, (problem, slot)) of each live request whose protected prefix (a radix hit, locked;
    ``ReqKv.cache_protected_len``) is not all held by the prefix tree: the tree evicted a locked node,
    or handed out a prefix whose slots it no longer holds."""
    out = []
    # the space req_to_token addresses: full KV, or an all-SWA model's window slots
    space = next(s for s, kind in engine.state_types.items() if kind.row_addressed)
    units = set(cached.get(space, ()))
    ps = fam.config.page_size
    for req in engine.requests.values():
        n = req.kv.cache_protected_len
        if req.node != node or req.phase is Phase.RETRACTED or not n:
            continue
        tokens = engine.lookup.tokens(fam, req.kv.req_pool_idx, 0, n)
        for position, slot in enumerate(tokens.tolist()):
            if slot // ps not in units:
                out.append((req.rid, space, (
                    f"position {position} of its protected prefix (the first {n}, locked in the prefix tree) sits in "
                    f"{space} slot {slot}, which the tree no longer holds (evicted while locked, or a stale match)", slot)))
                break
    return out
