"""A small serving engine over two real families (prefill and decode nodes) and their references.

Every operation runs on the real pools in SGLang's call order and on the reference model;
``check`` then compares them (:mod:`poolfuzz.harness.checks`): outcomes, lengths, conservation,
slot ownership and, slot by slot, the contents of every component of every request the step
touched. The forward pass's traceable writes live in :mod:`poolfuzz.harness.forward`.
"""

from __future__ import annotations

from typing import Callable

from poolfuzz.harness import failures, row_cache, turns
from poolfuzz.harness.checks import Checker
from poolfuzz.harness.forward import Writer
from poolfuzz.harness.ledger import ComponentSpec
from poolfuzz.harness.records import NO_CULPRIT, NODES, EngineOptions, Phase, Request, StepRecord
from poolfuzz.harness.state_types import CachedPrefixes, SlotLookup, state_types_for
from poolfuzz.harness.taint import KnownBugTaint
from poolfuzz.pools.capabilities import capabilities_of, factory_capabilities, nodes_pools_origin
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.family import build_family
from poolfuzz.pools.reference import ReferenceFamily
from poolfuzz.pools.request import ReqKv

__all__ = ["NODES", "NO_CULPRIT", "Engine", "EngineOptions", "Phase", "Request", "StepRecord"]

FLUSH_AFTER = 1  # requests a node serves between two flushes (see ``flushable``)
FamilyFactory = Callable[..., object]  # factory(config, *, device, faults, backup_mode) -> a pool family


class _Blame:
    """``with engine._blame(rid):``: slots freed inside are poisoned with ``rid`` as the culprit, so a
    reader of one names it. One reusable object per engine: it is entered on every pool call."""

    __slots__ = ("engine", "rid")

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.rid = NO_CULPRIT

    def __call__(self, rid: int) -> "_Blame":
        self.rid = rid
        return self

    def __enter__(self) -> None:
        self.engine.culprit = self.rid

    def __exit__(self, *exc) -> bool:
        self.engine.culprit = NO_CULPRIT
        return False


class Engine(KnownBugTaint):
    """Plays one serving deployment (a prefill and a decode node) over real pool families."""

    # The operations a program may call, in the order the README lists them; everything else
    # public is a query (``live``, ``pressure``, ...) or a check.
    OPERATIONS = ("admit", "prefill", "decode", "decode_speculative", "evict_swa", "retract", "resume",
                  "abort", "finish", "transfer", "fork", "next_turn", "flush")

    def __init__(self, *, config: ModelConfig, device="cpu", faults=(), backup_mode: str | None = None,
                 options: EngineOptions = EngineOptions(), family_factory: FamilyFactory = build_family):
        self.config = config
        self.options = options
        # One family per node; the factory is called once for each, in NODES order. A factory that builds
        # each node as its own server role (``builds_per_node``: SGLang's PD decode server) is told the node.
        per_node = factory_capabilities(family_factory).builds_per_node
        self.families = {n: family_factory(config, device=device, faults=faults, backup_mode=backup_mode,
                                           **({"node": n} if per_node else {}))
                         for n in NODES}
        # What each family can do, read once and checked (a misspelt capability is a ConfigError here).
        self.caps = {n: capabilities_of(f) for n, f in self.families.items()}
        # Who built the pools the example runs on (a node on pools the engine did not build makes the example so).
        self.pools_origin = nodes_pools_origin({n: c.pools_origin for n, c in self.caps.items()})
        first = self.families["prefill"]
        self.device = first.device
        self.backup_mode: str = first.backup_mode  # the retraction path the families run
        # A family whose engine counts capacity its own way (vLLM's shared block pool, SGLang's
        # prefix tree) names the reference model of it, each node its own: ``reference_factory(config,
        # backup_mode=..., **capabilities)`` (the family's capabilities the reference follows). The
        # config is the family's: where the engine sized a pool otherwise than the config asked (the
        # state slots a release's servers give the rows), the reference counts what was built.
        self.refs = {n: (self.caps[n].reference_factory or ReferenceFamily)(
                         f.config, backup_mode=f.backup_mode, resume_swa_tail_only=self.caps[n].resume_swa_tail_only)
                     for n, f in self.families.items()}
        self.ledger = row_cache.shared_ledger()  # expected checksums: pure caches shared across examples
        # What the checks need of each component (no tensors), and the rules of each index space.
        self.specs = {(c.name, c.layer): ComponentSpec.of(c) for c in first.components()}
        self.host_specs = {(c.name, c.layer): ComponentSpec.of(c) for c in first.host_components()}
        self.state_types = state_types_for(first.free_lists())
        self.cached_prefixes = CachedPrefixes()  # what a prefix cache holds for itself
        self.lookup = SlotLookup()  # a request's token and SWA slots, read without tensor ops
        self.requests: dict[int, Request] = {}  # live requests (retracted ones included) by rid
        self.retracted: dict[str, list[int]] = {n: [] for n in NODES}  # per node, in resume order
        self.finished: dict[int, turns.FinishedTurn] = {}  # what a next turn continues (see turns.py)
        self.next_rid = 1
        self.served: dict[str, int] = dict.fromkeys(NODES, 0)  # requests ended on each node since its last flush
        self.step = 0  # operations run so far; the failing one is named by it
        self.op = "init"  # the operation running (or last run)
        # The last request-level action the step ran: the op itself, or the retract / resume a decode
        # ran on its own. A failure's signature names it, so a state lost on a resume is one bug
        # whether the resume was a step of its own or ran inside a decode.
        self.action = "init"
        self.pending: tuple[str, dict] | None = None  # (op, args) of the operation running until it records
        self.culprit = NO_CULPRIT  # the request whose operation frees slots now (see _blame)
        self._blame = _Blame(self)  # ``with self._blame(rid):`` sets and resets the culprit
        self.touched: set[int] = set()  # requests this step changed: their contents are checked
        self.events: set[str] = set()  # labels of this step for Hypothesis statistics
        self.broken = False  # True from the start of an operation until its check has passed
        self.closed = False
        self.log: list[StepRecord] = []  # the program so far
        self.stats = {"checksum_calls": 0, "slots_checked": 0, "sweeps": 0}
        self.waived: dict[str, int] = {}  # violations of waived checks, counted instead of raised
        self.passed_over: dict[str, int] = {}  # violations of known bugs (by signature), passed over
        self.tearing_down = False  # the final sweep and drain: a failure's signature says "teardown"
        # (space, slot) of known bugs passed over in this example; (space, None) a whole space,
        # ("*", None) everything. A new failure there is downstream of the known bug, not a new one.
        self.taint: set[tuple] = set()
        # Requests a known bug touched, and every request derived from one (a fork copies its state;
        # a transfer keeps its id): a failure of theirs follows from the known bug through the copy.
        self.tainted_requests: set[int] = set()
        self.writer = Writer(self)  # forward writes, padding and poison
        self.checker = Checker(self)  # every invariant, the content checks and the audits
        for node, fam in self.families.items():
            fam.set_free_listener(self.writer.poisoner(node))
        self.checker.audit_predicate()

    # ======================================================================================
    # Bookkeeping shared by every operation
    # ======================================================================================
    def _begin(self, op: str, args: dict) -> None:
        self.broken = True  # until this step's check passes
        self.step += 1
        self.op = self.action = op
        self.pending = (op, args)
        self.touched = set()
        self.events = set()

    def longer_than_context(self, seqlen: int) -> bool:
        """Whether a new request of ``seqlen`` tokens is longer than the model's context: a server refuses it (its
        row holds ``max_context`` positions), so it is recorded refused and nothing is allocated."""
        if seqlen <= self.config.max_context:
            return False
        self._record(f"refused: {seqlen} tokens, longer than the {self.config.max_context}-token context")
        return True

    def _record(self, outcome: str) -> None:
        op, args = self.pending
        self.log.append(StepRecord(op=op, args=args, outcome=outcome))
        self.pending = None

    def pending_step(self, exc: BaseException) -> StepRecord | None:
        """The operation that raised ``exc`` before recording itself, as the record it would have written."""
        if self.pending is None:
            return None
        op, args = self.pending
        return StepRecord(op=op, args=dict(args), outcome=f"raised {type(exc).__name__}")

    def live(self, phase: Phase, node: str | None = None) -> list[Request]:
        return [r for r in self.requests.values() if r.phase is phase and (node is None or r.node == node)]

    def _both(self, node: str, rid: int, ref_call, real_call) -> PoolExhausted | None:
        """Run the reference, then the real pools; they must agree on success or on the space exhausted."""
        predicted = None
        try:
            ref_call()
        except PoolExhausted as exc:
            predicted = exc
        try:
            with self._blame(rid):
                real_call()
            actual = None
        except PoolExhausted as exc:
            actual = exc
        except PoolError as exc:
            self.checker.diagnose()
            raise failures.reference_mismatch(
                step=self.step, op=self.op, action=self.action, node=node, rid=rid, check="pool-error",
                space=getattr(exc, "space", None), slot=getattr(exc, "slot", None),
                detail=f"req {rid}: the pools raised {type(exc).__name__}: {exc}") from exc
        if (predicted is None) != (actual is None) or (predicted and predicted.space != actual.space):
            want = "success" if predicted is None else f"{predicted.space} exhausted"
            got = "success" if actual is None else f"{actual.space} exhausted"
            self.checker.diagnose()
            raise failures.reference_mismatch(
                step=self.step, op=self.op, action=self.action, node=node, rid=rid, check="outcome",
                space=(predicted or actual).space, expected=want, found=got,
                detail=f"req {rid}: reference predicts {want}, pools gave {got}" + (f" ({actual})" if actual else ""))
        return actual

    def _extend(self, req: Request, end: int) -> PoolExhausted | None:
        """KV for ``req``'s positions up to ``end``, in the reference and the real family."""
        fam, ref = self.families[req.node], self.refs[req.node]
        return self._both(req.node, req.rid, lambda: ref.extend(req.rid, end),
                          lambda: fam.protocol.extend(req.kv, fam, end))

    # ======================================================================================
    # Operations. Each resolves its request, runs reference and real pools, records the step.
    # ======================================================================================
    def admit(self, prompt_len: int) -> int | None:
        self._begin("admit", {"prompt_len": prompt_len})
        node = "prefill"
        fam, ref = self.families[node], self.refs[node]
        rid = self.next_rid
        if self.longer_than_context(prompt_len):
            return None
        kv = ReqKv(rid=rid, seqlen=prompt_len)
        err = self._both(node, rid, lambda: ref.admit(rid, seqlen=prompt_len), lambda: fam.protocol.admit(kv, fam))
        if err:
            self._record(f"{err.space} exhausted")
            return None
        self.next_rid += 1
        self.requests[rid] = Request(rid=rid, node=node, prompt_len=prompt_len, kv=kv, phase=Phase.PREFILLING)
        self.touched.add(rid)
        self._record(f"Req({rid}) row {kv.req_pool_idx}"
                     + (f" mamba slot {kv.mamba_pool_idx}" if kv.mamba_pool_idx is not None else ""))
        return rid

    def prefill(self, rid: int, chunk: int) -> bool:
        """One extend forward of up to ``chunk`` prompt tokens; the last chunk samples a token."""
        self._begin("prefill", {"rid": rid, "chunk": chunk})
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        start = req.kv.kv_committed_len
        end = min(req.prompt_len, start + chunk)
        self._maybe_evict(req, start)
        err = self._extend(req, end)
        if err:
            self._record(f"{err.space} exhausted")
            return False
        fam.protocol.run_deferred_mamba_ops([req.kv], fam)
        self.writer.forward(req, start, end)
        ref.commit(rid, end)
        after = self.caps[req.node].after_prefill  # a prefix tree takes what was computed
        if after is not None:
            with self._blame(rid):
                after(req.kv, fam)
        req.verb = "prefilled"
        if end == req.prompt_len:
            req.phase = Phase.RUNNING
            req.kv.seqlen = req.prompt_len + 1  # the first output token is sampled
            ref.sample(rid)
        self.touched.add(rid)
        self._record(f"positions {start}..{end}")
        return True

    def decode(self, rids: list[int]) -> list[int]:
        """One decode step for these running requests. A request whose slot does not fit makes the
        node retract SGLang's victim and tries once more (``retract_decode``). One that still does not
        fit waits; the victim itself is retracted (aborted, if its backup does not fit)."""
        self._begin("decode", {"rids": list(rids)})
        done, notes, decoded_nodes = [], [], set()
        for rid in rids:
            req = self.requests.get(rid)
            if req is None or req.phase is not Phase.RUNNING:  # retracted (or aborted) as a victim above
                continue
            ref = self.refs[req.node]
            pos = req.kv.seqlen - 1
            if pos + 1 > self.config.max_context:  # its row is full: the scheduler finished it by length
                notes.append(f"Req({rid}) is at its context length")
                continue
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
            self.writer.forward(req, pos, pos + 1)
            ref.commit(rid, pos + 1)
            req.kv.seqlen += 1
            ref.sample(rid)
            req.verb = "decoded"
            self.touched.add(rid)
            done.append(rid)
            decoded_nodes.add(req.node)
        outcome = "; ".join([f"decoded {done}"] + notes)
        for node in NODES:
            if node not in decoded_nodes:
                continue
            self.writer.padding(node)
            if self.options.resume_after_decode and self.retracted[node]:
                _, resumed = self._try_resume(node)
                outcome += f"; resume: {resumed}"
        self._record(outcome)
        return done

    def decode_speculative(self, rid: int, draft: int, accepted: int, tree: bool = False) -> bool:
        """A speculative (MTP / EAGLE) step: KV slots and writes for the input token plus ``draft``
        draft tokens, ``accepted`` of the drafts kept, then the over-allocated tail released. ``tree``:
        the drafts are a tree of two branches a level (EAGLE topk 2, NGRAM), so at most ``draft // 2``
        are accepted, and their KV moves to the window's front after verify."""
        if self.config.spec_draft_tokens:  # a verify checks at most this many tokens
            draft = min(draft, self.config.spec_draft_tokens - 1)
        # The request's row ends at the context length (only an all-SWA model's window lets a request get
        # there: the scheduler finishes it by length, and a verify never drafts past it)
        room = self.config.max_context - self.requests[rid].kv.seqlen
        draft = max(0, min(draft, room))  # logged as run: never a negative draft
        accepted = min(accepted, draft // 2 if tree else draft)
        self._begin("decode_speculative", {"rid": rid, "draft": draft, "accepted": accepted,
                                           **({"tree": True} if tree else {})})
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        pos = req.kv.seqlen - 1
        if room < 0:
            self._record(f"Req({rid}) is at its context length")
            return False
        self._maybe_evict(req, pos)
        err = self._extend(req, pos + 1 + draft)
        if err:
            self._record(f"{err.space} exhausted")
            return False
        self.writer.forward(req, pos, pos + 1 + accepted, written_end=pos + 1 + draft, verify=True, tree=tree)
        ref.verify(rid, pos, pos + 1 + draft)
        ref.commit(rid, pos + 1 + accepted)
        req.kv.seqlen += 1 + accepted
        ref.sample(rid, 1 + accepted)
        with self._blame(rid):
            fam.protocol.free_speculative_tail(req.kv, fam)
        ref.free_speculative_tail(rid)
        req.verb = "decoded speculatively"
        self.touched.add(rid)
        self.writer.padding(req.node)
        self._record(f"committed {req.kv.kv_committed_len}, allocated {req.kv.kv_allocated_len}")
        return True

    def _maybe_evict(self, req: Request, pre_len: int) -> None:
        """``ScheduleBatch.maybe_evict_swa`` before each forward (eviction interval 1)."""
        if not self.config.has_swa:
            return
        fam, ref = self.families[req.node], self.refs[req.node]
        before = req.kv.swa_evicted_seqlen
        ref.evict_swa(req.rid, pre_len)
        with self._blame(req.rid):
            fam.protocol.evict_swa(req.kv, fam, pre_len)
        if req.kv.swa_evicted_seqlen != before:
            self.touched.add(req.rid)
            self.events.add("SWA evicted")

    def evict_swa(self) -> None:
        """Free SWA slots that slid out of the window, for every running request."""
        self._begin("evict_swa", {})
        for req in self.live(Phase.RUNNING):
            self._maybe_evict(req, req.kv.seqlen - 1)
        self._record(f"touched {sorted(self.touched)}")

    def sglang_victim(self, node: str) -> int | None:
        """SGLang's retract order: fewest outputs first, then longest prompt; never the last one. None where the
        node's family declines retraction (``supports_retract = False``: no server of the engine backs its KV up)."""
        if not self.caps[node].supports_retract:
            return None
        running = self.live(Phase.RUNNING, node)
        if len(running) < 2:
            return None
        order = sorted(running, key=lambda r: (r.outputs, -r.prompt_len), reverse=True)
        return order[-1].rid

    def retract(self, rid: int) -> str:
        """Back up, release and queue a running request; a backup that does not fit aborts it."""
        self._begin("retract", {"rid": rid})
        status, detail = self._retract(rid)
        self._record(detail)
        return status

    def _retract(self, rid: int) -> tuple[str, str]:
        """``("retracted" | "aborted", what happened)``; the step's record is the caller's."""
        req = self.requests[rid]
        fam, ref = self.families[req.node], self.refs[req.node]
        self.action = "retract"
        snapshot = self.checker.slot_snapshot(req)
        err = self._both(req.node, rid, lambda: ref.retract(rid), lambda: fam.protocol.retract(req.kv, fam))
        if err:  # SGLang: retraction_backup returned False, the request is aborted
            with self._blame(rid):
                fam.protocol.release_kv(req.kv, fam)
            ref.finish(rid)
            self.served[req.node] += 1
            del self.requests[rid]
            return "aborted", f"aborted: {err.space} exhausted"
        backed_up = req.kv.retraction_backup.num_tokens
        if backed_up != ref.request(rid).backup_tokens:
            raise failures.reference_mismatch(
                step=self.step, op=self.op, action=self.action, node=req.node, rid=rid,
                check="backup-short" if backed_up < ref.request(rid).backup_tokens else "backup-long",
                detail=f"req {rid}'s retraction backup holds {backed_up} tokens; the seqlen-1 contract says "
                       f"{ref.request(rid).backup_tokens} (seqlen {req.kv.seqlen})")
        self.checker.audit_backup(req)
        req.phase = Phase.RETRACTED
        req.slots_before = snapshot
        req.verb = "retracted"
        self.retracted[req.node].append(rid)
        self.touched.add(rid)
        return "retracted", f"backup {req.kv.retraction_backup!r}"

    def resume(self, node: str) -> int | None:
        """Resume the first retracted request of the node, if it fits (SGLang walks in order)."""
        self._begin("resume", {"node": node})
        rid, outcome = self._try_resume(node)
        self._record(outcome)
        return rid

    def _try_resume(self, node: str) -> tuple[int | None, str]:
        if not self.retracted[node]:
            return None, "nothing retracted"
        rid = self.retracted[node][0]
        req = self.requests[rid]
        fam, ref = self.families[node], self.refs[node]
        self.action = "resume"
        # A family with a prefix cache says first what its lookup found (the engine's choice, as a
        # slot is); the reference predicts what the resume then costs.
        found = fam.protocol.lookup(req.kv, fam) if self.caps[node].prefix_caching else {}
        err = self._both(node, rid, lambda: ref.resume(rid, **found), lambda: fam.protocol.resume(req.kv, fam))
        if err:
            return None, f"Req({rid}) waits: {err.space} exhausted"
        if req.kv.recompute_from is not None:  # the family recomputes: the forward writes it again
            self.writer.recompute(req, req.kv.recompute_from, ref.request(rid))
            req.kv.recompute_from = None
        self.retracted[node].pop(0)
        req.phase = Phase.RUNNING
        req.verb = "resumed"
        self.touched.add(rid)
        return rid, (f"Req({rid}) row {req.kv.req_pool_idx}"
                     + (f" mamba slot {req.kv.mamba_pool_idx}" if req.kv.mamba_pool_idx is not None else ""))

    def abort(self, rid: int) -> None:
        """Abort a request in any phase; a retracted one's backup is discarded. Nothing may leak."""
        self._begin("abort", {"rid": rid})
        req = self.requests.pop(rid)
        fam, ref = self.families[req.node], self.refs[req.node]
        with self._blame(rid):
            fam.protocol.abort(req.kv, fam)
        if req.phase is Phase.RETRACTED:
            ref.discard(rid)
            self.retracted[req.node].remove(rid)
        else:
            ref.finish(rid)
            self.served[req.node] += 1
        self._record(f"was {req.phase.value}")

    def finish(self, rid: int) -> None:
        self._begin("finish", {"rid": rid})
        req = self.requests.pop(rid)
        fam, ref = self.families[req.node], self.refs[req.node]
        turns.remember(self, req)
        release = self.caps[req.node].finish or fam.protocol.release_kv  # a family may group its frees
        with self._blame(rid):
            release(req.kv, fam)
        ref.finish(rid)
        self.served[req.node] += 1
        self._record("released")

    def transfer(self, rid: int) -> bool:
        """PD: pre-allocate on the decode node, move every state component, release the prefill side."""
        self._begin("transfer", {"rid": rid})
        req = self.requests[rid]
        src_fam, dst_fam = self.families["prefill"], self.families["decode"]
        src_ref, dst_ref = self.refs["prefill"], self.refs["decode"]
        length = req.kv.kv_committed_len
        dst = ReqKv(rid=rid, seqlen=req.kv.seqlen)
        err = self._both("decode", rid, lambda: dst_ref.pre_alloc(rid, length),
                         lambda: dst_fam.protocol.pre_alloc(dst, dst_fam, length))
        if err:
            self._record(f"waits: decode {err.space} exhausted")
            return False
        snapshot = self.checker.slot_snapshot(req)
        record = src_fam.transfer.transfer(src=req.kv, src_family=src_fam, dst=dst, dst_family=dst_fam)
        dst_ref.adopt(rid, src_ref.request(rid))
        with self._blame(rid):
            src_fam.protocol.release_kv(req.kv, src_fam)
        src_ref.finish(rid)
        self.served["prefill"] += 1
        req.kv = dst
        req.node = "decode"
        req.slots_before = snapshot
        req.verb = req.origin = "transferred"
        self.touched.add(rid)
        self._record(f"state {list(record.state_types)}")
        return True

    def fork(self, src_rid: int, extra: int) -> int | None:
        """A new request whose prompt starts with the source's committed tokens (radix hit + COW)."""
        self._begin("fork", {"src_rid": src_rid, "extra": extra})
        src = self.requests[src_rid]
        fam, ref = self.families[src.node], self.refs[src.node]
        rid = self.next_rid
        prefix = src.kv.kv_committed_len
        if self.longer_than_context(prefix + extra):
            return None
        kv = ReqKv(rid=rid, seqlen=prefix + extra)
        err = self._both(src.node, rid, lambda: ref.fork(src_rid, rid, seqlen=prefix + extra),
                         lambda: fam.protocol.fork(src.kv, kv, fam))
        if err:
            self._record(f"{err.space} exhausted")
            return None
        self.next_rid += 1
        req = Request(rid=rid, node=src.node, prompt_len=prefix + extra, kv=kv, phase=Phase.PREFILLING,
                      verb="forked", origin="forked")
        req.expected = {key: vec[:prefix].clone() for key, vec in src.expected.items()}
        self.requests[rid] = req
        if kv.recompute_from is not None:  # the tree matched less than the prefix: computed again
            self.writer.recompute(req, kv.recompute_from, ref.request(rid))
            kv.recompute_from = None
        if src_rid in self.tainted_requests:
            self.tainted_requests.add(rid)  # it starts from the source's (suspect) state
        self.touched.add(rid)
        self._record(f"Req({rid}) prefix {prefix}")
        return rid

    def next_turn(self, src_rid: int, extra: int) -> int | None:
        """A chat's next turn: finished request ``src_rid``'s tokens, then ``extra`` of its own."""
        return turns.next_turn(self, src_rid, extra)

    def flushable(self) -> list[str]:
        """Nodes whose family can flush (``flush_cache``), with no request live and ``FLUSH_AFTER`` served
        since their last flush (one: 3 shifted which seeds find the catalogue's bugs and found no more)."""
        return [n for n in NODES if self.served[n] >= FLUSH_AFTER and self.caps[n].flush_cache is not None
                and not any(r.node == n for r in self.requests.values())]

    def flush(self, node: str) -> None:
        """The idle node's ``flush_cache`` (as after an RL weight update): its prefix cache is dropped and
        its pools reset in place. Every pool must then be whole, and serve the requests that follow."""
        self._begin("flush", {"node": node})
        self.checker.check_engine_idle(node)
        with self._blame(NO_CULPRIT):
            self.caps[node].flush_cache()
        self.refs[node].flush_cache()
        self.served[node] = 0
        self.checker.check_whole((node,), check="flush-leak", when="after the flush reset its pools")
        self._record("pools reset")

    # ======================================================================================
    # Checks and queries
    # ======================================================================================
    def check(self) -> None:
        """Every invariant, after every step; contents of touched requests, all of them periodically."""
        self.checker.check()

    def sweep(self) -> None:
        """Every invariant over every live request and free list (teardown)."""
        self.tearing_down = True
        self.checker.sweep()

    def drain(self) -> None:
        """Finish every request and abort every retracted one; every pool must then be whole."""
        self.tearing_down = True
        for req in list(self.requests.values()):
            if req.phase is Phase.RETRACTED:
                self.abort(req.rid)
            else:
                self.finish(req.rid)
            self.check()
        for node, fam in self.families.items():  # an idle server may evict its whole prefix cache
            self.checker.check_engine_idle(node)
            flush = self.caps[node].flush_prefix_cache
            if flush is not None:
                with self._blame(NO_CULPRIT):
                    flush()
                self.refs[node].flush_prefix_cache()
        self.checker.check_whole()

    def close(self) -> None:
        """The example is over: each family that holds something beyond it (a ``close`` method, e.g.
        SGLang's HiCache storage threads and their directory) lets it go. Called after teardown; once.
        ``with engine:`` closes it at the end of the block."""
        if self.closed:
            return
        self.closed = True
        for caps in self.caps.values():
            if caps.close is not None:
                caps.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pressure(self) -> float:
        """The fullest device pool's used fraction, over both nodes (0 empty, 1 exhausted)."""
        return self.checker.pressure()

    def occupancy(self) -> str:
        parts = []
        for node, fam in self.families.items():
            free = " ".join(f"{s}={a.available_size()}" for s, a in fam.free_lists().items())
            parts.append(f"{node}[{free}]")
        return " ".join(parts)
