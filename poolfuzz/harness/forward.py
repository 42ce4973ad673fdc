"""The forward pass as the pools see it: traceable KV and state writes, padded-batch writes, poison.

Every row written is derived from (request, position, layer, component), so a checksum mismatch
names whose data sits in a slot; every freed slot is overwritten with poison naming the request
whose operation freed it.
"""

from __future__ import annotations

import torch

from poolfuzz.harness import row_cache
from poolfuzz.harness.contents import KIND_PADDING, chain_affine
from poolfuzz.harness.records import NO_CULPRIT, Request
from poolfuzz.pools.speculative import scratch_name

_EMPTY = torch.empty(0, dtype=torch.int64)


def tree_depths(window: int, device) -> torch.Tensor:
    """A verify window over a draft tree of two branches a level, in SGLang's breadth-first order: node 0
    is the last sampled token, nodes ``2d - 1`` and ``2d`` are the two drafts at depth ``d``."""
    return torch.tensor([(j + 1) // 2 for j in range(window)], dtype=torch.int64, device=device)


def tree_verifies(engine) -> bool:
    """Whether the engine issues tree verifies: a family whose pools move accepted rows
    (``supports_tree_drafts``), and no per-step speculative scratch (a tree would need it per node)."""
    return engine.caps["prefill"].supports_tree_drafts and not engine.config.spec_draft_tokens


def accepted_node(depth: int) -> int:
    """The window node of the accepted draft at ``depth``: the path runs down the second branch, so every
    accepted row but none of the front ones sits where the chain layout would put it."""
    return 2 * depth


def _off_path(window: int, device) -> torch.Tensor:
    """The window's nodes off the accepted path (built from :func:`accepted_node`, so the two never
    disagree): the branch the verify rejects, whose drafts are written as rejected ones."""
    mask = torch.ones(window, dtype=torch.bool)
    mask[0] = False  # the last sampled token: the root, on every path
    for depth in range(1, (window + 1) // 2 + 1):
        if accepted_node(depth) < window:
            mask[accepted_node(depth)] = False
    return mask.to(device)


class Writer:
    """The writes of one engine's forward passes, onto the families' own buffers."""

    def __init__(self, engine):
        self.engine = engine
        # Per node: ((component, spec, state type) of the KV pool, (component, spec) of the recurrent
        # state), listed once: a family's components never change after it is built.
        self._plans: dict[str, tuple[list, list]] = {}

    def _plan(self, node: str) -> tuple[list, list]:
        plan = self._plans.get(node)
        if plan is None:
            e = self.engine
            fam = e.families[node]
            pool = fam.req_pool.mamba_pool
            plan = self._plans[node] = (
                [(c, e.specs[(c.name, c.layer)], e.state_types[c.space]) for c in fam.kv_pool.components()],
                [] if pool is None else [(c, e.specs[(c.name, c.layer)]) for c in pool.components()])
        return plan

    def forward(self, req: Request, start: int, end: int, *, written_end: int | None = None,
                verify: bool = False, tree: bool = False) -> None:
        """Write KV for positions ``[start, written_end)`` in every layer, then commit ``[start, end)``:
        the recurrent state consumes those tokens. A speculative step writes KV for its draft
        tokens too (``written_end > end``) but commits only the accepted ones; where the mamba pool
        keeps speculative scratch (``spec_scratch``) a ``verify`` forward writes the state after each
        token there and the family's commit copies the accepted one's into the state. A ``tree`` verify
        lays the drafts out as a tree (:func:`tree_depths`): the accepted path's KV lands on its nodes'
        slots, and the family moves it to the front of the window."""
        e = self.engine
        fam = e.families[req.node]
        written_end = end if written_end is None else written_end
        slots = fam.req_pool.read(req.kv.req_pool_idx, start, written_end)
        kv_plan, state_plan = self._plan(req.node)
        targets: dict[str, torch.Tensor] = {}  # space -> this forward's slots in it, worked out once
        # A pool with a write door of its own (``writes_through_engine``) files the rows itself, as an
        # attention backend has it do; what the door does not take is written here.
        caps = e.caps[req.node]
        door = {} if caps.kv_writes_through_engine else None
        depths = tree_depths(written_end - start, e.device) if tree else None
        off_path = _off_path(written_end - start, e.device) if tree else None
        for comp, spec, state_type in kv_plan:
            rows = row_cache.kv_rows(spec, req.rid, start, written_end, e.device)
            if depths is not None:  # each tree node holds the KV of its depth's position
                rows = rows[depths]
                # the branch the path never takes holds rejected drafts, told apart by their chain byte
                rejected = row_cache.rejected_draft_rows(spec, req.rid, start, written_end, e.device)[depths]
                rows[off_path] = rejected[off_path]
            if door is None:
                self._write_rows(fam, comp, state_type, slots, rows, targets)
            else:
                door[(comp.name, comp.layer)] = (comp, state_type, rows)
            req.expected[spec.key] = torch.cat([req.expected.get(spec.key, _EMPTY),
                                                e.ledger.kv(spec, req.rid, start, end)])
        if door:
            batch = {key: rows for key, (_, _, rows) in door.items()}
            # A chain verify commits its accepted prefix through the verified-prefix door, where there is one
            verified = caps.kv_write_verified_rows if verify and not tree and written_end > end else None
            done = (verified(slots, batch, committed=end - start) if verified is not None
                    else fam.kv_pool.write_rows(slots, batch))
            for key, (comp, state_type, rows) in door.items():
                if key not in done:
                    self._write_rows(fam, comp, state_type, slots, rows, targets)
        if tree and end - start > 1:  # move_accept_tokens_to_target_kvcache: the path to the window's front
            accepted = range(1, end - start)
            fam.protocol.move_accepted(req.kv, fam, tgt=slots[list(accepted)],
                                       src=slots[[accepted_node(d) for d in accepted]])
        req.kv.kv_committed_len = end
        if state_plan:
            # optional (interface.py): a family without speculative scratch declares none
            scratch = caps.spec_scratch if verify else None
            if scratch is None:
                self._fold_state(req, state_plan, start, end)
            else:
                self._verify_state(req, scratch, state_plan, start, end, written_end)

    def _fold_state(self, req: Request, plan: list, start: int, end: int) -> None:
        """The recurrent state consumes ``[start, end)``: read the chain it holds, write the next."""
        e = self.engine
        a, b = chain_affine(req.rid, start, end)
        # Extra-buffer mode: the forward also leaves the state it ends with in a track slot
        fam = e.families[req.node]
        track = fam.protocol.next_track_slot(req.kv, fam) if req.kv.mamba_track else None
        if e.device.type == "cpu":  # the same fold on host ints: no tensor ops, nothing to sync
            idx = req.kv.mamba_pool_idx
            for comp, spec in plan:
                old_chain = int(comp.tensor[idx].reshape(-1)[7:8].to(torch.int64))  # read the state
                comp.tensor[idx] = row_cache.state_row(spec, req.rid, end, (old_chain * a + b) % 251)
                if track is not None:
                    comp.tensor[track] = comp.tensor[idx]
            return
        slot = torch.tensor([req.kv.mamba_pool_idx], device=e.device)
        for comp, spec in plan:
            old_chain = comp.tensor[slot].reshape(1, -1)[:, 7].to(torch.int64)  # read the state
            new_chain = (old_chain * a + b) % 251
            comp.tensor[slot] = row_cache.state_rows(spec, req.rid, end, new_chain, e.device)
            if track is not None:
                comp.tensor[track] = comp.tensor[slot.item()]

    def _write_rows(self, fam, comp, state_type, slots: torch.Tensor, rows: torch.Tensor, targets: dict) -> None:
        target = targets.get(comp.space)
        if target is None:
            target = targets[comp.space] = state_type.write_targets(fam, slots).to(self.engine.device)
        comp.tensor[comp.at(target)] = rows

    def _verify_state(self, req: Request, scratch, plan: list, start: int, end: int, written_end: int) -> None:
        """Target verify: the state after each of ``[start, written_end)`` goes to the request's scratch row,
        draft step by step, each tagged as the state it is; then the family commits ``[start, end)``."""
        e = self.engine
        fam = e.families[req.node]
        idx, row = req.kv.mamba_pool_idx, req.kv.req_pool_idx
        steps = {(c.name, c.layer): c for c in scratch.components()}
        for comp, spec in plan:
            old_chain = int(comp.tensor[idx].reshape(-1)[7:8].to(torch.int64))  # read the state
            for t in range(written_end - start):
                a, b = chain_affine(req.rid, start, start + t + 1)
                steps[(scratch_name(comp.name, t), comp.layer)].tensor[row] = row_cache.state_row(
                    spec, req.rid, start + t + 1, (old_chain * a + b) % 251)
        track = fam.protocol.next_track_slot(req.kv, fam) if req.kv.mamba_track else None
        fam.protocol.commit_speculative(req.kv, fam, accepted_step=end - start - 1,
                                        drafted_steps=written_end - start, track_slot=track)

    def recompute(self, req: Request, start: int, ref) -> None:
        """A resume that recomputes (vLLM's preemption): positions ``[start, committed)`` get their KV
        again, each from the request whose token it is, and the state is rebuilt from all tokens.
        Where the resume allocated the last sampled token too, its KV is computed in that step (the
        block may enter the prefix cache): the next decode writes the same rows there again."""
        e = self.engine
        fam = e.families[req.node]
        end = min(req.kv.kv_allocated_len, req.kv.seqlen)
        kv_plan, state_plan = self._plan(req.node)
        if end > start:
            slots = fam.req_pool.read(req.kv.req_pool_idx, start, end)
            owners = list(ref.kv_owner) + [req.rid] * (end - len(ref.kv_owner))
            for comp, spec, state_type in kv_plan:
                target = state_type.write_targets(fam, slots).to(e.device)
                lo = start
                while lo < end:  # one write per run of positions of one owner
                    hi = lo + 1
                    while hi < end and owners[hi] == owners[lo]:
                        hi += 1
                    rows = row_cache.kv_rows(spec, owners[lo], lo, hi, e.device)
                    part = target[lo - start:hi - start]
                    kept = part != 0  # slot 0: no slot (a position the window left behind), not written
                    comp.tensor[comp.at(part[kept])] = rows[kept]  # page-major components too (DSA index keys)
                    lo = hi
        if state_plan and ref.state:
            held = req.kv.state_recompute_from
            if held is not None:  # the state continues from the family's copy-on-write
                req.kv.state_recompute_from = None
                self._continue_state(req, ref, state_plan, held)
                return
            rid, _, gen = ref.state[-1]
            for comp, spec in state_plan:
                comp.tensor[req.kv.mamba_pool_idx] = row_cache.state_row(spec, rid, gen, e.ledger.chain(ref.state))

    def _continue_state(self, req: Request, ref, plan: list, held: int) -> None:
        """The forward of a recompute that starts from a copied state: the family's deferred
        operations run (the copy-on-write of a state after ``held`` tokens, or the clear of a fresh
        slot), then the state consumes the history's tokens after ``held``, each segment as the
        request whose tokens they are. A copy from the wrong slot, or of a state the tree let
        change, leaves a wrong chain, which the contents check names."""
        e = self.engine
        fam = e.families[req.node]
        fam.protocol.run_deferred_mamba_ops([req.kv], fam)
        idx = req.kv.mamba_pool_idx
        for rid, start, end in ref.state:
            start = max(start, held)
            if start >= end:
                continue
            a, b = chain_affine(rid, start, end)
            for comp, spec in plan:
                old_chain = int(comp.tensor[idx].reshape(-1)[7:8].to(torch.int64))  # read the state
                comp.tensor[idx] = row_cache.state_row(spec, rid, end, (old_chain * a + b) % 251)

    def padding(self, node: str) -> None:
        """A padded (CUDA-graph) batch writes its dummy rows to slot 0 of every component:
        harmless by design, unless slot 0 was handed to a request (SGLang #17404). A family that pads
        with an unwritten slot id instead (``pads_slot_zero = False``: vLLM's -1) is not written."""
        e = self.engine
        fam = e.families[node]
        if not e.caps[node].pads_slot_zero:
            return
        zero = torch.zeros(1, dtype=torch.int64, device=e.device)
        for comp in fam.components():
            spec = e.specs[(comp.name, comp.layer)]
            comp.tensor[comp.at(zero)] = row_cache.tagged_rows(spec, kind=KIND_PADDING, rid=NO_CULPRIT, position=e.step,
                                                      chain=0, n=1, device=e.device)

    def poisoner(self, node: str):
        """The free listener of one node: overwrite freed slots with poison naming the culprit."""
        e = self.engine
        plans: dict[str, list] = {}  # space -> (component, spec) of the node's buffers in it, listed once

        def poison(space: str, slots: torch.Tensor) -> None:
            if not e.options.poison or slots.numel() == 0:
                return
            plan = plans.get(space)
            if plan is None:
                fam = e.families[node]
                if e.state_types[space].on_device:
                    listed = [(c, spec) for c, spec, _ in e.checker.component_readers(node, fam)]
                else:
                    listed = [(c, e.host_specs[(c.name, c.layer)]) for c in fam.host_components()]
                plan = plans[space] = [(c, spec) for c, spec in listed if c.space == space]
            for comp, spec in plan:
                comp.tensor[comp.at(slots.to(comp.tensor.device))] = row_cache.poison_rows(
                    spec, culprit=e.culprit, step=e.step, n=slots.numel(), device=comp.tensor.device)
        return poison
