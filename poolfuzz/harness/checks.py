"""The checks run after every engine step: reference agreement, slot ownership, free lists and,
slot by slot, the contents of every component of every request the step touched."""

from __future__ import annotations

import numpy as np
import torch

from poolfuzz.harness import failures, row_cache
from poolfuzz.harness.audits import audit_backup, audit_predicate
from poolfuzz.harness.checksums import SlotReader, slot_checksums
from poolfuzz.harness.contents import describe_row
from poolfuzz.harness.ledger import ComponentSpec
from poolfuzz.harness.records import NODES, Phase, Request
from poolfuzz.harness.sharing import audit_protected_prefixes, audit_shared_units
from poolfuzz.harness.storage_audit import audit_storage
from poolfuzz.pools.allocator import TokenAllocator
from poolfuzz.pools.speculative import draft_step

_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_POSITION = np.array([-1], dtype=np.int64)


class Checker:
    """Every invariant of one engine, and the report that names whose data is where."""

    def __init__(self, engine):
        self.engine = engine
        # Per node: (component, spec, checksum reader) of every device component, made once (the
        # pools allocate their buffers at construction; checked cheaply on every use).
        self._readers: dict[str, list] = {}
        self._scalars: dict[int, torch.Tensor] = {}  # expected state checksum -> 1-element tensor
        self._pressure_plan: list | None = None  # (allocator, capacity) of every device space
        self._owned: dict[str, list] = {}  # per node: (space, state type) of every device space
        self._passed_over: set[tuple] = set()  # (check, space) of known bugs passed over in this example
        self._known_keys = frozenset(failures.bug_key(s) for s in engine.options.known)

    def fail(self, failure: failures.PoolfuzzFailure) -> None:
        """Raise ``failure``, unless its check is waived or it is a known bug that can be passed over:
        then count it and let the checks go on (see ``EngineOptions``)."""
        e = self.engine
        d = failure.divergence
        if d.check in e.options.waive:
            e.waived[d.check] = e.waived.get(d.check, 0) + 1
            return
        if d.check in failures.WAIVABLE and e.options.known:
            key = (d.check, d.space)
            signature = failures.signature_of(failure, in_teardown=e.tearing_down)
            root = failures.bug_key(signature) in self._known_keys
            if root or key in self._passed_over or e.tainted(d):
                if root:  # a known bug: what it touched is suspect; what follows from it is not widened
                    self._passed_over.add(key)
                    e.taint_with(d)
                elif d.rid is not None:  # ... but a request it reached is, and so is a fork of it
                    e.tainted_requests.add(d.rid)
                e.passed_over[signature] = e.passed_over.get(signature, 0) + 1
                return
        raise failure

    def diagnose(self) -> None:
        """Before the engine raises a failure that ends the example (a pool error, an outcome the
        reference disagrees with) while known bugs are given: look for a known bug's broken state
        behind it (a slot held and free at once), whose taint then marks the failure as downstream.
        The operation stopped half-done, so a new violation seen here is not reported: the failure
        being raised is the one to report."""
        if not self.engine.options.known:
            return
        for check in (self._check_holdings, self._check_free_lists):
            try:
                check()
            except Exception:  # noqa: BLE001 - see the docstring: only the taint of known bugs counts here
                pass

    def invariant(self, check: str, detail: str, node: str = "", *, space: str | None = None,
                  kind: str = "invariant", slot: int | None = None, rid: int | None = None) -> None:
        """An InvariantViolation of ``check`` at the current step (raised unless waived)."""
        e = self.engine
        self.fail(failures.invariant(step=e.step, op=e.op, action=e.action, detail=detail, node=node, kind=kind,
                                     check=check, space=space, slot=slot, rid=rid))

    # --- entry points ----------------------------------------------------------------------
    def check(self) -> None:
        e = self.engine
        e.broken = True  # until every check below has passed
        sweep = e.options.sweep_interval and e.step % e.options.sweep_interval == 0
        if sweep:
            e.stats["sweeps"] += 1
            self._run(list(e.requests.values()), free_lists=True)
        else:
            self._run([e.requests[r] for r in sorted(e.touched) if r in e.requests], free_lists=False)
        e.broken = False

    def sweep(self) -> None:
        self._run(list(self.engine.requests.values()), free_lists=True)

    def _run(self, reqs: list[Request], *, free_lists: bool) -> None:
        self._check_holdings()
        self._check_reference()
        if free_lists:
            self._check_free_lists()
        self._check_contents(reqs)
        audit_storage(self.engine, self.fail)  # pages stored since the last check (HiCache's L3)

    def check_whole(self, nodes=NODES, *, check: str = "leak", when: str = "after every request ended") -> None:
        """After every request of ``nodes`` ended (and the drain or a flush emptied their caches): every
        pool of theirs is back to its full size. ``check`` names the violation: a leak the drain finds is
        one bug, units a flush's reset kept another."""
        e = self.engine
        for node in nodes:
            for space, alloc in e.families[node].free_lists().items():
                total = e.refs[node].capacity[space]
                if alloc.available_size() != total:
                    self.invariant(
                        check, f"{when}, {space} has {alloc.available_size()} of {total} free (leak)", node,
                        space=space)

    def check_engine_idle(self, node: str) -> None:
        """A node with no request left: the engine's own idle memory check (the family's ``idle_problem``,
        where it has one) must find nothing either; what it reports is a finding whoever is wrong."""
        ask = self.engine.caps[node].idle_problem
        problem = ask() if ask is not None else None
        if problem:
            self.invariant("engine-idle-check", f"the engine's own idle memory check reports: {problem}", node)

    def audit_predicate(self) -> None:
        audit_predicate(self.engine, self.invariant)

    def audit_backup(self, req: Request) -> None:
        audit_backup(self.engine, req, self.invariant, self.state_checksum)

    def pressure(self) -> float:
        e = self.engine
        if self._pressure_plan is None:  # the allocators of a family never change: list them once
            self._pressure_plan = [
                (alloc, e.refs[node].capacity[space])
                for node, fam in e.families.items()
                for space, alloc in fam.free_lists().items() if e.state_types[space].on_device]
        return max((1.0 - alloc.available_size() / total for alloc, total in self._pressure_plan if total),
                   default=0.0)

    # --- structure -------------------------------------------------------------------------
    def _check_reference(self) -> None:
        e = self.engine
        for req in e.requests.values():
            r = e.refs[req.node].request(req.rid)
            real = (req.kv.kv_allocated_len, req.kv.kv_committed_len, req.kv.swa_evicted_seqlen, req.kv.seqlen)
            want = (r.allocated, r.committed, r.swa_lo, r.seqlen)
            if req.phase is not Phase.RETRACTED and real != want:
                # The space of a lengths signature is the first length that differs.
                field = next(n for n, a, b in zip(("allocated", "committed", "swa_evicted", "seqlen"), real, want)
                             if a != b)
                self.fail(failures.reference_mismatch(
                    step=e.step, op=e.op, action=e.action, node=req.node, rid=req.rid, check="lengths", space=field,
                    detail=f"req {req.rid} (allocated, committed, swa_evicted, seqlen) = {real}, reference {want}"))
        for node, fam in e.families.items():
            ref = e.refs[node]
            for space, alloc in fam.free_lists().items():
                real = alloc.available_size()
                want = ref.available(space)
                if real != want:
                    self.fail(failures.reference_mismatch(
                        step=e.step, op=e.op, action=e.action, node=node, check="free-count", space=space,
                        detail=f"{space} pool has {real} free but the reference says {want} "
                               f"(leak, double free or lost free)"))
            live = {r.rid for r in e.requests.values() if r.node == node}
            if ref.live() != live:
                self.fail(failures.reference_mismatch(
                    step=e.step, op=e.op, action=e.action, node=node, check="live-requests",
                    detail=f"live requests {sorted(live)} vs reference {sorted(ref.live())}"))

    def _check_holdings(self) -> None:
        """No slot held twice, none of them reserved, none of them in a free list; and what the kernels read to
        find a request's state (row-to-mamba mapping, full_to_swa of every held token) points at what it holds."""
        e = self.engine
        for node, fam in e.families.items():
            lists = fam.free_lists()
            owned = self._owned.get(node)
            if owned is None:
                owned = self._owned[node] = [(s, e.state_types[s]) for s in lists if e.state_types[s].on_device]
            held: dict[str, list[int]] = {space: [] for space, _ in owned}
            shared = e.caps[node].shared_unit_spaces
            # (unit, rid) of every held unit of each space whose units a prefix cache shares
            held_by: dict[str, list[tuple[int, int]]] = {space: [] for space, _ in owned if space in shared}
            misread: list = []  # (rid, space, (problem, slot)) of state the kernels would not find
            for req in e.requests.values():
                if req.node != node or req.phase is Phase.RETRACTED:
                    continue
                tokens = e.lookup.tokens(fam, req.kv.req_pool_idx, 0, req.kv.kv_allocated_len)
                for space, state_type in owned:
                    units = state_type.held_units(e.lookup, fam, req.kv, tokens)
                    held[space] += units
                    if space in held_by:
                        held_by[space] += [(u, req.rid) for u in units]
                    # What the kernels read to find the state points at what the request holds (one pass;
                    # reported after the holdings: a slot freed while held also loses its mapping).
                    problem = state_type.consumer_problem(e.lookup, fam, req.kv, tokens)
                    if problem is not None:
                        misread.append((req.rid, space, problem))
            cached = e.cached_prefixes.held_units(e.caps[node])
            for space, units in cached.items():
                held[space] += units  # the prefix cache's own checkpoints
            if cached:
                misread += audit_protected_prefixes(e, node, fam, cached)
            if shared:
                audit_shared_units(e, node, fam, held_by, self.invariant)
            for space, units in held.items():
                alloc = lists[space]
                is_free = (alloc._is_free.__getitem__ if type(alloc).is_free_page is TokenAllocator.is_free_page
                           else alloc.is_free_page)
                if alloc.is_free_page(0):
                    self.invariant("reserved", f"{space} free list holds the reserved slot/page 0 (padding): "
                                   "it will be handed out", node, space=space, slot=0)
                if len(set(units)) != len(units):
                    dup = next(u for u in units if units.count(u) > 1)
                    self.invariant("ownership", f"{space} slot/page {dup} is held by two owners", node, space=space,
                                   slot=dup)
                for u in units:
                    if u == 0:
                        rid = self._holder_of(node, fam, space, u)
                        self.invariant("reserved", f"{space} slot/page 0 (reserved padding) was handed out "
                                       f"(held by {_holder(rid)})", node, space=space, slot=0, rid=rid)
                    elif is_free(u):
                        rid = self._holder_of(node, fam, space, u)
                        self.invariant("ownership", f"{space} slot/page {u} is held (by {_holder(rid)}) but also in "
                                       "the free list", node, space=space, slot=u, rid=rid)
            for rid, space, (problem, slot) in misread:
                self.invariant("consumer-map", f"req {rid}: {problem}", node, space=space, slot=slot, rid=rid)

    def _holder_of(self, node: str, fam, space: str, unit: int) -> int | None:
        """The live request holding ``unit`` of ``space`` (None: the prefix cache). Looked up only when a
        holdings check fails, so the every-step pass keeps no owner per unit."""
        e = self.engine
        state_type = e.state_types[space]
        for req in e.requests.values():
            if req.node != node or req.phase is Phase.RETRACTED:
                continue
            tokens = e.lookup.tokens(fam, req.kv.req_pool_idx, 0, req.kv.kv_allocated_len)
            if unit in list(state_type.held_units(e.lookup, fam, req.kv, tokens)):
                return req.rid
        return None

    def _check_free_lists(self) -> None:
        e = self.engine
        for node, fam in e.families.items():
            for space, alloc in fam.free_lists().items():
                problem = alloc.free_list_problem()  # O(pages freed so far), not O(pool)
                if problem:
                    self.invariant("free-list", f"{space} {problem}", node, space=space)

    # --- contents --------------------------------------------------------------------------
    def component_readers(self, node: str, fam) -> list:
        """(component, spec, checksum reader) of every device component of a node."""
        plan = self._readers.get(node)
        if plan is None or any(r.buffer.data_ptr() != c.tensor.data_ptr() or r.buffer.shape != c.tensor.shape
                               for c, _, r in plan[:1]):
            e = self.engine
            plan = [(c, e.specs[(c.name, c.layer)], SlotReader(c.tensor, page_size=c.page_size))
                    for c in fam.components()]
            self._readers[node] = plan
        return plan

    def state_checksum(self, spec: ComponentSpec, history: tuple) -> int:
        """The expected checksum of a state row after ``history``: from the table the write used
        (one build serves every chain value), or the cleared row's."""
        ledger = self.engine.ledger
        if not history:
            return ledger.state(spec, history)
        rid, _, gen = history[-1]
        return row_cache.state_checksum(spec, rid, gen, ledger.chain(history))

    def _check_contents(self, reqs: list[Request]) -> None:
        """Compare, per component in one batched gather, every expected slot with its checksum.
        Slots are worked out once per (request, index space), as numpy index arrays."""
        e = self.engine
        batches = []  # (comp, node, parts, slots, expected, got)
        for node, fam in e.families.items():
            node_reqs = [r for r in reqs if r.node == node and r.phase is not Phase.RETRACTED]
            if node_reqs:
                located: dict = {}  # (rid, space) -> (positions, slots), shared by the space's components
                for comp, spec, reader in self.component_readers(node, fam):
                    parts = []
                    for r in node_reqs:
                        p = self._expected_slots(fam, r, spec, located)
                        if p is not None and len(p[0]):
                            parts.append((r, *p))
                    if not parts:
                        continue
                    if len(parts) == 1:
                        slots, expected = parts[0][2], parts[0][3]
                    else:
                        slots = np.concatenate([p[2] for p in parts])
                        expected = torch.cat([p[3] for p in parts])
                    got = reader(slots)
                    e.stats["checksum_calls"] += 1
                    e.stats["slots_checked"] += len(slots)
                    batches.append((comp, node, parts, slots, expected, got))
            for req in reqs:
                if req.node == node and req.phase is Phase.RETRACTED:
                    batches += self._host_batches(fam, node, req)
        if not batches:
            return
        if _all_equal(batches):
            return
        for comp, node, parts, slots, expected, got in batches:
            # The first wrong slot of each request: a waived or known one is counted and the others
            # of the batch are still checked (``fail`` raises the first that is neither).
            seen = set()
            for index in (got.cpu() != expected).nonzero().flatten().tolist():
                failure = self._explain(comp, node, parts, slots, index)
                if failure.divergence.rid not in seen:
                    seen.add(failure.divergence.rid)
                    self.fail(failure)

    def _expected_slots(self, fam, req: Request, spec: ComponentSpec, located: dict):
        """(positions, slots, expected checksums) of one component of one request, or None."""
        e = self.engine
        ref = e.refs[req.node].request(req.rid)
        state_type = e.state_types[spec.space]
        if state_type.scratch:
            return self._scratch_slots(req, ref, spec)
        if state_type.recurrent:
            if ref.pending_state is not None or ref.state is None:
                return None  # a fresh slot before its first extend, or a pending copy-on-write
            where = (req.rid, spec.space)
            if where not in located:
                located[where] = state_type.locate(e.lookup, fam, req, e.config)
            value = self.state_checksum(spec, ref.state)
            expected = self._scalars.get(value)
            if expected is None:
                expected = self._scalars[value] = torch.tensor([value])
            tracked = state_type.tracked(req, ref) if req.kv.mamba_track else ()
            if tracked:  # extra-buffer mode: each track slot holds the state a forward left there
                positions, slots = located[where]
                return (np.concatenate([positions, np.full(len(tracked), -1)]),
                        np.concatenate([slots, np.array([s for s, _ in tracked], dtype=np.int64)]),
                        torch.cat([expected, torch.tensor([self.state_checksum(spec, h) for _, h in tracked])]))
            return (*located[where], expected)
        where = (req.rid, spec.space)
        found = located.get(where)
        if found is None:
            positions, slots = state_type.locate(e.lookup, fam, req, e.config)
            i = state_type.unmapped(slots)
            if i is not None:
                position = int(positions[i])
                raise failures.state_lost(
                    step=e.step, op=e.op, node=req.node, rid=req.rid, component=spec.name,
                    layer=spec.layer, position=position, slot_before=self._before(req, spec.space, position),
                    slot_after=0, expected=f"req {ref.kv_owner[position]} pos {position}",
                    found=f"no {spec.space.upper()} slot (unmapped inside the attention window)", verb=req.verb,
                    space=spec.space, check="unmapped", action=_action_of(e, req))
            lo = int(positions[0]) if len(positions) else 0
            found = located[where] = (positions, slots, lo)
        positions, slots, lo = found
        return positions, slots, req.expected.get(spec.key, _EMPTY)[lo:req.kv.kv_committed_len]

    def _scratch_slots(self, req: Request, ref, spec: ComponentSpec):
        """A speculative scratch step of the request's row: the state the last verify left there, if any."""
        history = _scratch_history(ref, spec.name)
        if history is None:
            return None
        return (_NO_POSITION, np.array([req.kv.req_pool_idx], dtype=np.int64),
                torch.tensor([self.state_checksum(spec, history)]))

    def _host_batches(self, fam, node: str, req: Request) -> list:
        backup = req.kv.retraction_backup
        if backup is None or not backup.host_transfers:
            return []
        e = self.engine
        out = []
        ref = e.refs[node].request(req.rid)
        for t in backup.host_transfers:
            pool = fam.host_pools[t.space]
            for comp in pool.components():
                spec = e.host_specs[(comp.name, comp.layer)]
                first, n = t.first_position, t.num_tokens
                positions = torch.arange(first, first + n)
                expected = e.ledger.kv_for_owners(spec, ref.kv_owner, first, first + n)
                slots = t.host_indices[:n]
                got = slot_checksums(comp.tensor, slots)
                e.stats["checksum_calls"] += 1
                out.append((comp, node, [(req, positions, slots, expected)], slots, expected, got))
        return out

    def _explain(self, comp, node, parts, slots, index):
        e = self.engine
        for req, positions, req_slots, expected in parts:
            if index < len(req_slots):
                break
            index -= len(req_slots)
        slot = int(req_slots[index])
        state_type = e.state_types[comp.space]
        position = None if state_type.recurrent or state_type.scratch else int(positions[index])
        ref = e.refs[node].request(req.rid)
        if state_type.scratch:
            expected = (f"{e.ledger.describe_state(_scratch_history(ref, comp.name))}, in draft step "
                        f"{draft_step(comp.name)} of its scratch row")
        else:
            expected = state_type.describe_expected(e.ledger, ref, position)
        if state_type.recurrent and slot in req.kv.mamba_track:  # a track slot of extra-buffer mode
            history = dict(state_type.tracked(req, ref)).get(slot)
            expected = f"{e.ledger.describe_state(history)}, in track slot {req.kv.mamba_track.index(slot)}"
        return failures.state_lost(step=e.step, op=e.op, node=node, rid=req.rid, component=comp.name,
                                   layer=comp.layer, position=position,
                                   slot_before=self._before(req, comp.space, position), slot_after=slot,
                                   expected=expected,
                                   found=describe_row(comp.tensor[comp.at(slot)].cpu()), verb=req.verb, space=comp.space,
                                   action=_action_of(e, req))

    # --- where a request's slots were ------------------------------------------------------
    def slot_snapshot(self, req: Request) -> dict:
        """Every device slot the request holds now, by space: kept across a retract or transfer."""
        e = self.engine
        fam = e.families[req.node]
        tokens = e.lookup.tokens(fam, req.kv.req_pool_idx, 0, req.kv.kv_committed_len)
        out = {}
        for space, state_type in e.state_types.items():
            snap = state_type.snapshot(e.lookup, fam, req.kv, tokens)
            if snap is not None or state_type.recurrent:
                out[space] = snap
        return out

    def _before(self, req: Request, space: str, position: int | None):
        snap = req.slots_before
        if snap is None or space not in snap:
            return None
        return self.engine.state_types[space].slot_before(snap[space], position)


def _scratch_history(ref, name: str):
    step = draft_step(name)
    return ref.scratch[step] if step is not None and step < len(ref.scratch) else None


def _holder(rid: int | None) -> str:
    return "the prefix cache" if rid is None else f"req {rid}"


def _action_of(engine, req: Request) -> str:
    """The action a lost-state signature names: the step's; a prefill is marked with how its request
    came to be (a forked request's prefill runs the copy-on-write, an admitted one's the clear of a
    fresh slot: two places a state can be lost, so two bugs)."""
    if engine.action == "prefill" and req.origin != "admitted":
        return f"prefill.{req.origin}"
    return engine.action


def _all_equal(batches: list) -> bool:
    """Whether every batch read back what it expected, with one host sync for the device batches.

    The host pools' batches are read on the CPU while the device pools' are read on the GPU: each
    group is compared where it lives (one ``torch.stack`` over both would mix devices).
    """
    on_device = [(b[5] != b[4].to(b[5].device)).any() for b in batches if b[5].device.type != "cpu"]
    if not all(torch.equal(b[5], b[4]) for b in batches if b[5].device.type == "cpu"):
        return False
    return not on_device or not bool(torch.stack(on_device).any())  # the one host sync of a passing check
