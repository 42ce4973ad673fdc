"""A small serving engine over two real families (prefill and decode nodes) and their references.

Every operation runs on the real pools in SGLang's call order and on the reference model;
``check`` then compares them: outcomes, lengths, conservation, slot ownership and, slot by
slot, the contents of every component of every request the step touched.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np
import torch

from poolfuzz.harness import failures, row_cache
from poolfuzz.harness.checksums import SlotReader, row_checksums, slot_checksums
from poolfuzz.harness.contents import KIND_PADDING, chain_affine, describe_row
from poolfuzz.harness.ledger import ComponentSpec
from poolfuzz.pools.allocator import TokenAllocator
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.family import PoolFamily, build_family
from poolfuzz.pools.reference import ReferenceFamily
from poolfuzz.pools.req_to_token import ReqToTokenPool
from poolfuzz.pools.swa_allocator import SWATokenAllocator
from poolfuzz.pools.request import ReqKv

NODES = ("prefill", "decode")
NO_CULPRIT = 0xFFFF
_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_POSITION = np.array([-1], dtype=np.int64)


class Phase(enum.Enum):
    PREFILLING = "prefilling"
    RUNNING = "running"
    RETRACTED = "retracted"


@dataclass(kw_only=True)
class Request:
    """The engine's view of one request; ``kv`` is what the pools see."""

    rid: int
    node: str
    prompt_len: int
    kv: ReqKv
    phase: Phase
    verb: str = "admitted"  # what last happened to it, for messages
    expected: dict = field(default_factory=dict)  # component key -> expected checksums by position
    slots_before: dict | None = None  # physical slots at the last retract / transfer

    def __repr__(self) -> str:
        return f"Req({self.rid})"

    @property
    def outputs(self) -> int:
        return self.kv.seqlen - self.prompt_len if self.phase is not Phase.PREFILLING else 0


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """``sweep_interval``: every N steps check every live slot, not just the touched ones.
    ``resume_after_decode``: after a decode step, try to resume the node's first retracted request,
    as SGLang's decode loop does every iteration (so resumes also happen under pool pressure).
    ``retract_on_decode_oom``: a decode that finds no KV slot retracts SGLang's victim and tries
    again, as ``retract_decode`` does, so retractions (and the resumes after them) happen exactly
    when the pools are short."""

    sweep_interval: int = 8
    poison: bool = True
    resume_after_decode: bool = True
    retract_on_decode_oom: bool = True

    # What a program recorded before an option existed ran with: replaying an old artifact must
    # play its steps as they were recorded, not under behaviour added since.
    RECORDED_BEFORE: ClassVar[dict[str, object]] = {"retract_on_decode_oom": False}


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One executed operation, with the requests it resolved to: the replayable program."""

    op: str
    args: dict
    outcome: str

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.op}({args})  # {self.outcome}"


FamilyFactory = Callable[..., PoolFamily]


class Engine:
    def __init__(self, *, config: ModelConfig, device="cpu", faults=(), backup_mode: str | None = None,
                 options: EngineOptions = EngineOptions(), family_factory: FamilyFactory = build_family):
        self.config = config
        self.options = options
        self.families = {n: family_factory(config, device=device, faults=faults, backup_mode=backup_mode)
                         for n in NODES}
        first = self.families["prefill"]
        self.device = first.device
        self.refs = {n: ReferenceFamily(config, backup_mode=f.backup_mode) for n, f in self.families.items()}
        self.ledger = row_cache.shared_ledger()  # pure caches, shared across examples
        self.specs = {(c.name, c.layer): ComponentSpec.of(c) for c in first.components()}
        self.host_specs = {(c.name, c.layer): ComponentSpec.of(c) for c in first.host_components()}
        self.requests: dict[int, Request] = {}
        self.retracted: dict[str, list[int]] = {n: [] for n in NODES}
        self.next_rid = 1
        self.step = 0
        self.op = "init"
        self.culprit = NO_CULPRIT
        self.touched: set[int] = set()
        self.broken = False
        self.log: list[StepRecord] = []
        self.stats = {"checksum_calls": 0, "slots_checked": 0, "sweeps": 0}
        self._readers: dict[str, list] = {}
        self._views: dict[int, tuple] = {}  # id(host tensor) -> (tensor, its numpy view)
        self._scalars: dict[int, torch.Tensor] = {}  # expected state checksum -> 1-element tensor
        for node, fam in self.families.items():
            fam.set_free_listener(self._poisoner(node))
        self._audit_predicate()

    # ======================================================================================
    # Operations. Each resolves its request, runs reference and real pools, records the step.
    # ======================================================================================
    def _begin(self, op: str) -> None:
        self.broken = True  # until this step's check passes
        self.step += 1
        self.op = op
        self.touched = set()
        self.events: set[str] = set()  # labels for Hypothesis statistics (``hypothesis.event``)

    def _record(self, op: str, args: dict, outcome: str) -> None:
        self.log.append(StepRecord(op=op, args=args, outcome=outcome))

    def live(self, phase: Phase, node: str | None = None) -> list[Request]:
        return [r for r in self.requests.values() if r.phase is phase and (node is None or r.node == node)]

    def _both(self, node: str, rid: int, ref_call, real_call) -> PoolExhausted | None:
        """Run the reference, then the real pools; they must agree on success or on the space exhausted."""
        predicted = None
        try:
            ref_call()
        except PoolExhausted as exc:
            predicted = exc
        self.culprit = rid
        try:
            real_call()
            actual = None
        except PoolExhausted as exc:
            actual = exc
        except PoolError as exc:
            raise failures.reference_mismatch(step=self.step, op=self.op, node=node, rid=rid,
                                              detail=f"req {rid}: the pools raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.culprit = NO_CULPRIT
        if (predicted is None) != (actual is None) or (predicted and predicted.space != actual.space):
            want = "success" if predicted is None else f"{predicted.space} exhausted"
            got = "success" if actual is None else f"{actual.space} exhausted ({actual})"
            raise failures.reference_mismatch(step=self.step, op=self.op, node=node, rid=rid,
                                              detail=f"req {rid}: reference predicts {want}, pools gave {got}")
        return actual

    def _extend(self, req: Request, end: int) -> PoolExhausted | None:
        """KV for ``req``'s positions up to ``end``, in the reference and the real family."""
        fam, ref = self.families[req.node], self.refs[req.node]
        return self._both(req.node, req.rid, lambda: ref.extend(req.rid, end),
                          lambda: fam.protocol.extend(req.kv, fam, end))

    def admit(self, prompt_len: int) -> int | None:
        self._begin("admit")
        node = "prefill"
        fam, ref = self.families[node], self.refs[node]
        rid = self.next_rid
        kv = ReqKv(rid=rid, seqlen=prompt_len)
        err = self._both(node, rid, lambda: ref.admit(rid), lambda: fam.protocol.admit(kv, fam))
        if err:
            ref.requests.pop(rid, None)
            self._record("admit", {"prompt_len": prompt_len}, f"{err.space} exhausted")
            return None
        self.next_rid += 1
        ref.requests[rid].seqlen = prompt_len
        self.requests[rid] = Request(rid=rid, node=node, prompt_len=prompt_len, kv=kv, phase=Phase.PREFILLING)
        self.touched.add(rid)
        self._record("admit", {"prompt_len": prompt_len}, f"Req({rid}) row {kv.req_pool_idx}"
                     + (f" mamba slot {kv.mamba_pool_idx}" if kv.mamba_pool_idx is not None else ""))
        return rid

    def prefill(self, rid: int, chunk: int) -> bool:
        """One extend forward of up to ``chunk`` prompt tokens; the last chunk samples a token."""
        self._begin("prefill")
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        start = req.kv.kv_committed_len
        end = min(req.prompt_len, start + chunk)
        self._maybe_evict(req, start)
        err = self._extend(req, end)
        if err:
            self._record("prefill", {"rid": rid, "chunk": chunk}, f"{err.space} exhausted")
            return False
        fam.protocol.run_deferred_mamba_ops([req.kv], fam)
        self._forward(req, start, end)
        ref.commit(rid, end)
        req.verb = "prefilled"
        if end == req.prompt_len:
            req.phase = Phase.RUNNING
            req.kv.seqlen = req.prompt_len + 1  # the first output token is sampled
            ref.requests[rid].seqlen = req.kv.seqlen
        self.touched.add(rid)
        self._record("prefill", {"rid": rid, "chunk": chunk}, f"positions {start}..{end}")
        return True

    def decode(self, rids: list[int]) -> list[int]:
        """One decode step for these running requests. A request whose slot does not fit makes the
        node retract SGLang's victim and tries once more (``retract_decode``). One that still does not
        fit waits; the victim itself is retracted (aborted, if its backup does not fit)."""
        self._begin("decode")
        done, notes, decoded_nodes = [], [], set()
        for rid in rids:
            req = self.requests.get(rid)
            if req is None or req.phase is not Phase.RUNNING:  # retracted (or aborted) as a victim above
                continue
            ref = self.refs[req.node]
            pos = req.kv.seqlen - 1
            self._maybe_evict(req, pos)
            err = self._extend(req, pos + 1)
            if err and self.options.retract_on_decode_oom:
                victim = self.sglang_victim(req.node)
                if victim is not None:
                    _, detail = self._retract(victim)
                    notes.append(f"{err.space} exhausted: retract Req({victim}), {detail}")
                    if victim == rid:
                        continue
                    err = self._extend(req, pos + 1)
            if err:
                continue
            self._forward(req, pos, pos + 1)
            ref.commit(rid, pos + 1)
            req.kv.seqlen += 1
            ref.requests[rid].seqlen = req.kv.seqlen
            req.verb = "decoded"
            self.touched.add(rid)
            done.append(rid)
            decoded_nodes.add(req.node)
        outcome = "; ".join([f"decoded {done}"] + notes)
        for node in NODES:
            if node not in decoded_nodes:
                continue
            self._padding_writes(node)
            if self.options.resume_after_decode and self.retracted[node]:
                _, resumed = self._try_resume(node)
                outcome += f"; resume: {resumed}"
        self._record("decode", {"rids": list(rids)}, outcome)
        return done

    def decode_speculative(self, rid: int, draft: int, accepted: int) -> bool:
        """A speculative (MTP / EAGLE) step: KV slots and writes for the input token plus ``draft``
        draft tokens, ``accepted`` of the drafts kept, then the over-allocated tail released."""
        self._begin("decode_speculative")
        accepted = min(accepted, draft)
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        pos = req.kv.seqlen - 1
        self._maybe_evict(req, pos)
        err = self._extend(req, pos + 1 + draft)
        args = {"rid": rid, "draft": draft, "accepted": accepted}
        if err:
            self._record("decode_speculative", args, f"{err.space} exhausted")
            return False
        self._forward(req, pos, pos + 1 + accepted, written_end=pos + 1 + draft)
        ref.commit(rid, pos + 1 + accepted)
        req.kv.seqlen += 1 + accepted
        ref.requests[rid].seqlen = req.kv.seqlen
        self.culprit = rid
        fam.protocol.free_speculative_tail(req.kv, fam)
        self.culprit = NO_CULPRIT
        ref.free_speculative_tail(rid)
        req.verb = "decoded speculatively"
        self.touched.add(rid)
        self._padding_writes(req.node)
        self._record("decode_speculative", args, f"committed {req.kv.kv_committed_len}, "
                     f"allocated {req.kv.kv_allocated_len}")
        return True

    def _maybe_evict(self, req: Request, pre_len: int) -> None:
        """``ScheduleBatch.maybe_evict_swa`` before each forward (eviction interval 1)."""
        if not self.config.has_swa:
            return
        fam, ref = self.families[req.node], self.refs[req.node]
        before = req.kv.swa_evicted_seqlen
        ref.evict_swa(req.rid, pre_len)
        self.culprit = req.rid
        fam.protocol.evict_swa(req.kv, fam, pre_len)
        self.culprit = NO_CULPRIT
        if req.kv.swa_evicted_seqlen != before:
            self.touched.add(req.rid)
            self.events.add("SWA evicted")

    def evict_swa(self) -> None:
        """Free SWA slots that slid out of the window, for every running request."""
        self._begin("evict_swa")
        for req in self.live(Phase.RUNNING):
            self._maybe_evict(req, req.kv.seqlen - 1)
        self._record("evict_swa", {}, f"touched {sorted(self.touched)}")

    def sglang_victim(self, node: str) -> int | None:
        """SGLang's retract order: fewest outputs first, then longest prompt; never the last one."""
        running = self.live(Phase.RUNNING, node)
        if len(running) < 2:
            return None
        order = sorted(running, key=lambda r: (r.outputs, -r.prompt_len), reverse=True)
        return order[-1].rid

    def retract(self, rid: int) -> str:
        """Back up, release and queue a running request; a backup that does not fit aborts it."""
        self._begin("retract")
        status, detail = self._retract(rid)
        self._record("retract", {"rid": rid}, detail)
        return status

    def _retract(self, rid: int) -> tuple[str, str]:
        """``("retracted" | "aborted", what happened)``; the step's record is the caller's."""
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        snapshot = self._slot_snapshot(req)
        err = self._both(req.node, rid, lambda: ref.retract(rid), lambda: fam.protocol.retract(req.kv, fam))
        if err:  # SGLang: retraction_backup returned False, the request is aborted
            self.culprit = rid
            fam.protocol.release_kv(req.kv, fam)
            self.culprit = NO_CULPRIT
            ref.finish(rid)
            del self.requests[rid]
            return "aborted", f"aborted: {err.space} exhausted"
        backed_up = req.kv.retraction_backup.num_tokens
        if backed_up != ref.requests[rid].backup_tokens:
            raise failures.reference_mismatch(
                step=self.step, op=self.op, node=req.node, rid=rid,
                detail=f"req {rid}'s retraction backup holds {backed_up} tokens; the seqlen-1 contract says "
                       f"{ref.requests[rid].backup_tokens} (seqlen {req.kv.seqlen})")
        self._audit_backup(req)
        req.phase = Phase.RETRACTED
        req.slots_before = snapshot
        req.verb = "retracted"
        self.retracted[req.node].append(rid)
        self.touched.add(rid)
        return "retracted", f"backup {req.kv.retraction_backup!r}"

    def resume(self, node: str) -> int | None:
        """Resume the first retracted request of the node, if it fits (SGLang walks in order)."""
        self._begin("resume")
        rid, outcome = self._try_resume(node)
        self._record("resume", {"node": node}, outcome)
        return rid

    def _try_resume(self, node: str) -> tuple[int | None, str]:
        if not self.retracted[node]:
            return None, "nothing retracted"
        rid = self.retracted[node][0]
        req = self.requests[rid]
        fam, ref = self.families[node], self.refs[node]
        err = self._both(node, rid, lambda: ref.resume(rid), lambda: fam.protocol.resume(req.kv, fam))
        if err:
            return None, f"Req({rid}) waits: {err.space} exhausted"
        self.retracted[node].pop(0)
        req.phase = Phase.RUNNING
        req.verb = "resumed"
        self.touched.add(rid)
        return rid, (f"Req({rid}) row {req.kv.req_pool_idx}"
                     + (f" mamba slot {req.kv.mamba_pool_idx}" if req.kv.mamba_pool_idx is not None else ""))

    def abort(self, rid: int) -> None:
        """Abort a request in any phase; a retracted one's backup is discarded. Nothing may leak."""
        self._begin("abort")
        req = self.requests.pop(rid)
        fam, ref = self.families[req.node], self.refs[req.node]
        self.culprit = rid
        fam.protocol.abort(req.kv, fam)
        self.culprit = NO_CULPRIT
        if req.phase is Phase.RETRACTED:
            ref.discard(rid)
            self.retracted[req.node].remove(rid)
        else:
            ref.finish(rid)
        self._record("abort", {"rid": rid}, f"was {req.phase.value}")

    def finish(self, rid: int) -> None:
        self._begin("finish")
        req = self.requests.pop(rid)
        fam, ref = self.families[req.node], self.refs[req.node]
        self.culprit = rid
        fam.protocol.release_kv(req.kv, fam)
        self.culprit = NO_CULPRIT
        ref.finish(rid)
        self._record("finish", {"rid": rid}, "released")

    def transfer(self, rid: int) -> bool:
        """PD: pre-allocate on the decode node, move every state component, release the prefill side."""
        self._begin("transfer")
        req = self.requests[rid]
        src_fam, dst_fam = self.families["prefill"], self.families["decode"]
        src_ref, dst_ref = self.refs["prefill"], self.refs["decode"]
        length = req.kv.kv_committed_len
        dst = ReqKv(rid=rid, seqlen=req.kv.seqlen)
        err = self._both("decode", rid, lambda: dst_ref.pre_alloc(rid, length),
                         lambda: dst_fam.protocol.pre_alloc(dst, dst_fam, length))
        if err:
            dst_ref.requests.pop(rid, None)
            self._record("transfer", {"rid": rid}, f"waits: decode {err.space} exhausted")
            return False
        snapshot = self._slot_snapshot(req)
        record = src_fam.transfer.transfer(src=req.kv, src_family=src_fam, dst=dst, dst_family=dst_fam)
        src_state = src_ref.requests[rid]
        moved = dst_ref.requests[rid]
        moved.seqlen = src_state.seqlen
        moved.kv_owner = list(src_state.kv_owner)
        moved.state = src_state.state
        self.culprit = rid
        src_fam.protocol.release_kv(req.kv, src_fam)
        self.culprit = NO_CULPRIT
        src_ref.finish(rid)
        req.kv = dst
        req.node = "decode"
        req.slots_before = snapshot
        req.verb = "transferred"
        self.touched.add(rid)
        self._record("transfer", {"rid": rid}, f"state {list(record.state_types)}")
        return True

    def fork(self, src_rid: int, extra: int) -> int | None:
        """A new request whose prompt starts with the source's committed tokens (radix hit + COW)."""
        self._begin("fork")
        src = self.requests[src_rid]
        fam, ref = self.families[src.node], self.refs[src.node]
        rid = self.next_rid
        prefix = src.kv.kv_committed_len
        kv = ReqKv(rid=rid, seqlen=prefix + extra)
        err = self._both(src.node, rid, lambda: ref.fork(src_rid, rid),
                         lambda: fam.protocol.fork(src.kv, kv, fam))
        if err:
            ref.requests.pop(rid, None)
            self._record("fork", {"src_rid": src_rid, "extra": extra}, f"{err.space} exhausted")
            return None
        self.next_rid += 1
        ref.requests[rid].seqlen = prefix + extra
        req = Request(rid=rid, node=src.node, prompt_len=prefix + extra, kv=kv, phase=Phase.PREFILLING,
                      verb="forked")
        req.expected = {key: vec[:prefix].clone() for key, vec in src.expected.items()}
        self.requests[rid] = req
        self.touched.add(rid)
        self._record("fork", {"src_rid": src_rid, "extra": extra}, f"Req({rid}) prefix {prefix}")
        return rid

    # ======================================================================================
    # The forward pass: traceable writes
    # ======================================================================================
    def _forward(self, req: Request, start: int, end: int, *, written_end: int | None = None) -> None:
        """Write KV for positions ``[start, written_end)`` in every layer, then commit ``[start, end)``:
        the recurrent state consumes those tokens. A speculative step writes KV for its draft
        tokens too (``written_end > end``) but commits only the accepted ones."""
        fam = self.families[req.node]
        written_end = end if written_end is None else written_end
        slots = fam.req_pool.read(req.kv.req_pool_idx, start, written_end)
        swa_slots = fam.allocator.translate(slots) if self.config.has_swa else None
        kv_plan, mamba_plan = self._write_plan(req.node)
        for comp, spec in kv_plan:
            target = swa_slots if comp.space == "swa" else slots
            comp.tensor[target.to(self.device)] = row_cache.kv_rows(spec, req.rid, start, written_end, self.device)
            req.expected[spec.key] = torch.cat([req.expected.get(spec.key, _EMPTY),
                                                self.ledger.kv(spec, req.rid, start, end)])
        req.kv.kv_committed_len = end
        if not mamba_plan:
            return
        a, b = chain_affine(req.rid, start, end)
        if self.device.type == "cpu":  # the same fold on host ints: no tensor ops, nothing to sync
            idx = req.kv.mamba_pool_idx
            for comp, spec in mamba_plan:
                old_chain = int(comp.tensor[idx].reshape(-1)[7:8].to(torch.int64))  # read the state
                comp.tensor[idx] = row_cache.state_row(spec, req.rid, end, (old_chain * a + b) % 251)
            return
        slot = torch.tensor([req.kv.mamba_pool_idx], device=self.device)
        for comp, spec in mamba_plan:
            old_chain = comp.tensor[slot].reshape(1, -1)[:, 7].to(torch.int64)  # read the state
            new_chain = (old_chain * a + b) % 251
            comp.tensor[slot] = row_cache.state_rows(spec, req.rid, end, new_chain, self.device)

    def _write_plan(self, node: str):
        """(component, spec) pairs of a node's KV pool and of its mamba pool, listed once."""
        plans = self.__dict__.setdefault("_write_plans", {})
        plan = plans.get(node)
        if plan is None:
            fam = self.families[node]
            pool = fam.req_pool.mamba_pool
            plan = plans[node] = (
                [(c, self.specs[(c.name, c.layer)]) for c in fam.kv_pool.components()],
                [] if pool is None else [(c, self.specs[(c.name, c.layer)]) for c in pool.components()])
        return plan

    def _padding_writes(self, node: str) -> None:
        """A padded (CUDA-graph) batch writes its dummy rows to slot 0 of every component:
        harmless by design, unless slot 0 was handed to a request (SGLang #17404)."""
        fam = self.families[node]
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        for comp in fam.components():
            spec = self.specs[(comp.name, comp.layer)]
            comp.tensor[zero] = row_cache.tagged_rows(spec, kind=KIND_PADDING, rid=NO_CULPRIT, position=self.step,
                                                      chain=0, n=1, device=self.device)

    def _poisoner(self, node: str):
        def poison(space: str, slots: torch.Tensor) -> None:
            if not self.options.poison or slots.numel() == 0:
                return
            fam = self.families[node]
            if space.startswith("host."):
                plan = [(c, self.host_specs[(c.name, c.layer)]) for c in fam.host_components()]
            else:  # the device components, listed once per node
                plan = [(c, spec) for c, spec, _ in self._component_readers(node, fam)]
            for comp, spec in plan:
                if comp.space == space:
                    comp.tensor[slots.to(comp.tensor.device)] = row_cache.poison_rows(
                        spec, culprit=self.culprit, step=self.step, n=slots.numel(), device=comp.tensor.device)
        return poison

    # ======================================================================================
    # Checks
    # ======================================================================================
    def check(self) -> None:
        """Every invariant, after every step; contents of touched requests, all of them periodically."""
        self.broken = True  # until every check below has passed
        sweep = self.options.sweep_interval and self.step % self.options.sweep_interval == 0
        if sweep:
            self.stats["sweeps"] += 1
            self._run_checks(list(self.requests.values()), free_lists=True)
        else:
            self._run_checks([self.requests[r] for r in sorted(self.touched) if r in self.requests],
                             free_lists=False)
        self.broken = False

    def sweep(self) -> None:
        """Every invariant over every live request and free list (teardown)."""
        self._run_checks(list(self.requests.values()), free_lists=True)

    def _run_checks(self, reqs: list[Request], *, free_lists: bool) -> None:
        self._check_holdings()
        self._check_reference()
        if free_lists:
            self._check_free_lists()
        self._check_contents(reqs)

    def _fail_invariant(self, detail: str, node: str = "", kind: str = "invariant"):
        return failures.invariant(step=self.step, op=self.op, detail=detail, node=node, kind=kind)

    def _check_reference(self) -> None:
        for req in self.requests.values():
            r = self.refs[req.node].requests[req.rid]
            real = (req.kv.kv_allocated_len, req.kv.kv_committed_len, req.kv.swa_evicted_seqlen, req.kv.seqlen)
            want = (r.allocated, r.committed, r.swa_lo, r.seqlen)
            if req.phase is not Phase.RETRACTED and real != want:
                raise failures.reference_mismatch(
                    step=self.step, op=self.op, node=req.node, rid=req.rid,
                    detail=f"req {req.rid} (allocated, committed, swa_evicted, seqlen) = {real}, reference {want}")
        for node, fam in self.families.items():
            ref = self.refs[node]
            for space, alloc in fam.free_lists().items():
                real = alloc.available_size()
                want = ref.available(space)
                if real != want:
                    raise failures.reference_mismatch(
                        step=self.step, op=self.op, node=node,
                        detail=f"{space} pool has {real} free but the reference says {want} "
                               f"(leak, double free or lost free)")
            live = {r.rid for r in self.requests.values() if r.node == node}
            if set(ref.requests) != live:
                raise failures.reference_mismatch(step=self.step, op=self.op, node=node,
                                                  detail=f"live requests {sorted(live)} vs reference {sorted(ref.requests)}")

    def _check_holdings(self) -> None:
        """No slot held twice, none of them reserved, none of them in a free list."""
        for node, fam in self.families.items():
            ps = self.config.page_size
            lists = fam.free_lists()
            held: dict[str, list[int]] = {space: [] for space in lists}
            for req in self.requests.values():
                if req.node != node or req.phase is Phase.RETRACTED:
                    continue
                kv = req.kv
                held["rows"].append(kv.req_pool_idx)
                tokens = self._tokens(fam, kv.req_pool_idx, 0, kv.kv_allocated_len)
                held["full"] += sorted({t // ps for t in tokens.tolist()})
                if "swa" in held:
                    held["swa"] += sorted({t // ps for t in self._swa_slots(fam, tokens).tolist() if t > 0})
                if kv.mamba_pool_idx is not None:
                    held["mamba"].append(kv.mamba_pool_idx)
                if kv.mamba_cow_src is not None:
                    held["mamba"].append(kv.mamba_cow_src)
            for space, units in held.items():
                if space.startswith("host."):
                    continue
                alloc = lists[space]
                is_free = (alloc._is_free.__getitem__ if type(alloc).is_free_page is TokenAllocator.is_free_page
                           else alloc.is_free_page)
                if alloc.is_free_page(0):
                    raise self._fail_invariant(
                        f"{space} free list holds the reserved slot/page 0 (padding): it will be handed out", node)
                if len(set(units)) != len(units):
                    dup = next(u for u in units if units.count(u) > 1)
                    raise self._fail_invariant(f"{space} slot/page {dup} is held by two owners", node)
                for u in units:
                    if u == 0:
                        raise self._fail_invariant(f"{space} slot/page 0 (reserved padding) was handed out", node)
                    if is_free(u):
                        raise self._fail_invariant(f"{space} slot/page {u} is held but also in the free list", node)

    def _check_free_lists(self) -> None:
        for node, fam in self.families.items():
            for space, alloc in fam.free_lists().items():
                if hasattr(alloc, "free_list_problem"):  # O(pages freed so far), not O(pool)
                    problem = alloc.free_list_problem()
                    if problem:
                        raise self._fail_invariant(f"{space} {problem}", node)
                    continue
                free = alloc.free_pages() if hasattr(alloc, "free_pages") else alloc.free_slots()
                if len(set(free)) != len(free):
                    raise self._fail_invariant(f"{space} free list holds duplicates (a double free went unseen)", node)
                if not space.startswith("host.") and 0 in free:
                    raise self._fail_invariant(f"{space} free list holds the reserved slot/page 0", node)

    def _check_contents(self, reqs: list[Request]) -> None:
        """Compare, per component in one batched gather, every expected slot with its checksum.
        Slots are worked out once per (request, index space), as numpy index arrays."""
        batches = []  # (comp, node, parts, slots, expected, got)
        for node, fam in self.families.items():
            node_reqs = [r for r in reqs if r.node == node and r.phase is not Phase.RETRACTED]
            if node_reqs:
                located: dict = {}  # (rid, space) -> (positions, slots), shared by the space's components
                for comp, spec, reader in self._component_readers(node, fam):
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
                    self.stats["checksum_calls"] += 1
                    self.stats["slots_checked"] += len(slots)
                    batches.append((comp, node, parts, slots, expected, got))
            for req in reqs:
                if req.node == node and req.phase is Phase.RETRACTED:
                    batches += self._host_batches(fam, node, req)
        if not batches:
            return
        if all(b[5].device.type == "cpu" for b in batches):
            if all(torch.equal(b[5], b[4]) for b in batches):
                return
        else:
            bad = torch.stack([(b[5] != b[4].to(b[5].device)).any() for b in batches])
            if not bool(bad.any()):  # the one host sync of a passing check
                return
        for comp, node, parts, slots, expected, got in batches:
            mismatch = (got.cpu() != expected).nonzero()
            if mismatch.numel():
                raise self._explain(comp, node, parts, slots, int(mismatch[0]))

    def _tokens(self, fam: PoolFamily, row: int, lo: int, hi: int) -> np.ndarray:
        """``req_pool.read(row, lo, hi)`` as int64 numpy; the stock host-side pool is read in place."""
        pool = fam.req_pool
        if type(pool).read is ReqToTokenPool.read and pool.req_to_token.device.type == "cpu":
            view = self._views.get(id(pool.req_to_token))
            if view is None:
                view = self._views[id(pool.req_to_token)] = (pool.req_to_token, pool.req_to_token.numpy())
            return view[1][row, lo:hi].astype(np.int64)
        return pool.read(row, lo, hi).cpu().numpy()

    def _swa_slots(self, fam: PoolFamily, tokens: np.ndarray) -> np.ndarray:
        """``allocator.translate(tokens)`` as int64 numpy; the stock mapping is read in place."""
        alloc = fam.allocator
        if type(alloc).translate is SWATokenAllocator.translate and alloc.full_to_swa.device.type == "cpu":
            view = self._views.get(id(alloc.full_to_swa))
            if view is None:
                view = self._views[id(alloc.full_to_swa)] = (alloc.full_to_swa, alloc.full_to_swa.numpy())
            return view[1][tokens]
        return alloc.translate(torch.from_numpy(tokens)).cpu().numpy()

    def _component_readers(self, node: str, fam: PoolFamily) -> list:
        """(component, spec, checksum reader) of every device component of a node, made once: the
        pools allocate their buffers at construction (checked cheaply on every use)."""
        plan = self._readers.get(node)
        if plan is None or any(r.buffer.data_ptr() != c.tensor.data_ptr() or r.buffer.shape != c.tensor.shape
                               for c, _, r in plan[:1]):
            plan = [(c, self.specs[(c.name, c.layer)], SlotReader(c.tensor)) for c in fam.components()]
            self._readers[node] = plan
        return plan

    def _state_checksum(self, spec: ComponentSpec, history: tuple) -> int:
        """The expected checksum of a state row after ``history``: from the table the write used
        (one build serves every chain value), or the cleared row's."""
        if not history:
            return self.ledger.state(spec, history)
        rid, _, gen = history[-1]
        return row_cache.state_checksum(spec, rid, gen, self.ledger.chain(history))

    def _expected_slots(self, fam: PoolFamily, req: Request, spec: ComponentSpec, located: dict | None = None):
        """(positions, slots, expected checksums) of one component of one request, or None.
        ``located`` memoises (positions, slots) per (request, space) across components."""
        kv = req.kv
        ref = self.refs[req.node].requests[req.rid]
        located = {} if located is None else located
        if spec.space == "mamba":
            if ref.pending_state is not None or ref.state is None:
                return None
            where = (req.rid, "mamba")
            if where not in located:
                located[where] = (_NO_POSITION, np.array([kv.mamba_pool_idx], dtype=np.int64))
            value = self._state_checksum(spec, ref.state)
            expected = self._scalars.get(value)
            if expected is None:
                expected = self._scalars[value] = torch.tensor([value])
            return (*located[where], expected)
        committed = kv.kv_committed_len
        lo = max(0, committed - self.config.sliding_window) if spec.space == "swa" else 0
        expected = req.expected.get(spec.key, _EMPTY)[lo:committed]
        where = (req.rid, spec.space)
        found = located.get(where)
        if found is None:
            slots = self._tokens(fam, kv.req_pool_idx, lo, committed)
            if spec.space == "swa":
                slots = self._swa_slots(fam, slots)
                unmapped = np.flatnonzero(slots <= 0)
                if unmapped.size:
                    i = int(unmapped[0])
                    raise failures.state_lost(
                        step=self.step, op=self.op, node=req.node, rid=req.rid, component=spec.name,
                        layer=spec.layer, position=lo + i, slot_before=self._before(req, "swa", lo + i),
                        slot_after=0, expected=f"req {ref.kv_owner[lo + i]} pos {lo + i}",
                        found="no SWA slot (unmapped inside the attention window)", verb=req.verb)
            found = located[where] = (np.arange(lo, committed), slots)
        return (*found, expected)

    def _host_batches(self, fam: PoolFamily, node: str, req: Request) -> list:
        backup = req.kv.retraction_backup
        if backup is None or not backup.host_transfers:
            return []
        out = []
        ref = self.refs[node].requests[req.rid]
        for t in backup.host_transfers:
            pool = fam.host_pools[t.space]
            for comp in pool.components():
                spec = self.host_specs[(comp.name, comp.layer)]
                first, n = t.first_position, t.num_tokens
                positions = torch.arange(first, first + n)
                expected = self.ledger.kv_for_owners(spec, ref.kv_owner, first, first + n)
                slots = t.host_indices[:n]
                got = slot_checksums(comp.tensor, slots)
                self.stats["checksum_calls"] += 1
                out.append((comp, node, [(req, positions, slots, expected)], slots, expected, got))
        return out

    def _explain(self, comp, node, parts, slots, index):
        for req, positions, req_slots, expected in parts:
            if index < len(req_slots):
                break
            index -= len(req_slots)
        slot = int(req_slots[index])
        pos = int(positions[index])
        found = describe_row(comp.tensor[slot].cpu())
        ref = self.refs[node].requests[req.rid]
        if comp.space == "mamba":
            want, position, before = self.ledger.describe_state(ref.state), None, self._before(req, "mamba", None)
        else:
            want = f"req {ref.kv_owner[pos]} pos {pos}"
            position, before = pos, self._before(req, comp.space, pos)
        return failures.state_lost(step=self.step, op=self.op, node=node, rid=req.rid, component=comp.name,
                                   layer=comp.layer, position=position, slot_before=before, slot_after=slot,
                                   expected=want, found=found, verb=req.verb)

    def _slot_snapshot(self, req: Request) -> dict:
        fam = self.families[req.node]
        kv = req.kv
        tokens = fam.req_pool.read(kv.req_pool_idx, 0, kv.kv_committed_len)
        snap = {"full": tokens.tolist(), "mamba": kv.mamba_pool_idx}
        if self.config.has_swa:
            snap["swa"] = fam.allocator.translate(tokens).tolist()
        return snap

    def _before(self, req: Request, space: str, position: int | None):
        snap = req.slots_before
        if snap is None or space not in snap:
            return None
        if space == "mamba":
            return snap["mamba"]
        return snap[space][position] if space.startswith(("full", "swa")) and position < len(snap[space]) else None

    # ======================================================================================
    # Audits
    # ======================================================================================
    def _audit_predicate(self) -> None:
        fam = self.families["prefill"]
        if fam.uses_ssm_state != fam.has_recurrent_state():
            has = "has" if fam.has_recurrent_state() else "has no"
            raise self._fail_invariant(
                f"uses_ssm_state({self.config.name}) is {fam.uses_ssm_state} but the built family {has} "
                "recurrent-state components: backup decisions read the predicate and would silently "
                "take the wrong path", kind="predicate")
        if fam.backup_mode == "host_pool" and fam.has_recurrent_state():
            raise self._fail_invariant(
                f"{self.config.name}: host_pool retraction backup chosen for a model with recurrent state; "
                "PD transfers its MAMBA state but a host_pool backup carries only full KV and SWA, so a "
                "retracted request would resume on a stale state", kind="predicate")

    def _audit_backup(self, req: Request) -> None:
        """What the KV pool's CPU copy really carried (seen through checksums) vs what it declares."""
        fam = self.families[req.node]
        backup = req.kv.retraction_backup
        ref = self.refs[req.node].requests[req.rid]
        if backup.mode != "cpu_tensor" or not fam.has_recurrent_state() or not ref.state:
            return
        specs = [s for s in self.specs.values() if s.space == "mamba"]
        wanted = {self._state_checksum(s, ref.state) for s in specs}
        carried = _checksums_in(backup.cpu_tensors, {s.row_shape for s in specs}) >= wanted
        in_mamba_cpu = backup.mamba_cpu is not None
        declared = type(fam.kv_pool).cpu_copy_carries_mamba
        name = type(fam.kv_pool).__name__
        if carried != declared:
            did = "carried" if carried else "did not carry"
            raise self._fail_invariant(
                f"{name} declares cpu_copy_carries_mamba={declared} but its CPU copy of req {req.rid} {did} "
                "the recurrent state", req.node, kind="capability")
        if carried and in_mamba_cpu:
            raise self._fail_invariant(
                f"req {req.rid}: recurrent state backed up twice (by {name}.get_cpu_copy and in mamba_cpu)",
                req.node, kind="capability")

    # ======================================================================================
    # Teardown
    # ======================================================================================
    def drain(self) -> None:
        """Finish every request and abort every retracted one; every pool must then be whole."""
        for req in list(self.requests.values()):
            if req.phase is Phase.RETRACTED:
                self.abort(req.rid)
            else:
                self.finish(req.rid)
            self.check()
        for node, fam in self.families.items():
            for space, alloc in fam.free_lists().items():
                total = self.refs[node].capacity[space]
                if alloc.available_size() != total:
                    raise self._fail_invariant(
                        f"after every request ended, {space} has {alloc.available_size()} of {total} free (leak)",
                        node)

    def pressure(self) -> float:
        """The fullest device pool's used fraction, over both nodes (0 empty, 1 exhausted)."""
        plan = getattr(self, "_pressure_plan", None)
        if plan is None:  # the allocators of a family never change: list them once
            plan = self._pressure_plan = [
                (alloc, self.refs[node].capacity[space])
                for node, fam in self.families.items()
                for space, alloc in fam.free_lists().items() if not space.startswith("host.")]
        return max((1.0 - alloc.available_size() / total for alloc, total in plan if total), default=0.0)

    def occupancy(self) -> str:
        parts = []
        for node, fam in self.families.items():
            free = " ".join(f"{s}={a.available_size()}" for s, a in fam.free_lists().items())
            parts.append(f"{node}[{free}]")
        return " ".join(parts)


def _checksums_in(payload, row_shapes: set[tuple[int, ...]]) -> set[int]:
    """Checksums of every row of every tensor in an opaque payload whose trailing shape fits."""
    out: set[int] = set()
    stack = [payload]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            for shape in row_shapes:
                k = len(shape)
                if obj.dim() >= k and tuple(obj.shape[-k:]) == shape and obj.numel():
                    out.update(row_checksums(obj.reshape(-1, *shape)).tolist())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dataclass_fields__"):
            stack.extend(getattr(obj, f) for f in obj.__dataclass_fields__)
    return out
