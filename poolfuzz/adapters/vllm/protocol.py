"""The harness's request lifecycle on vLLM's KVCacheManager, in the scheduler's call order."""

from __future__ import annotations

from dataclasses import dataclass

from poolfuzz.adapters.vllm.storage import zero_rows
from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.request import ReqKv, RetractionBackup

TOKENS_PER_REQUEST = 1 << 20  # token ids are rid * this + position: no two requests share a block hash


def token_id(rid: int, position: int) -> int:
    return rid * TOKENS_PER_REQUEST + position


@dataclass(kw_only=True)
class LiveRequest:
    """A request the manager knows: vLLM's own Request object and the input-batch row it runs in."""

    rid: int
    request: object  # vllm.v1.request.Request
    row: int | None = None


class VllmProtocol:
    """admit: a vLLM Request and an input-batch row; extend: ``allocate_slots``; resume (a finished request's
    next turn): the local prefix hit (``get_computed_blocks``) and ``allocate_slots`` for every token up to the
    last. No retract (``VllmFamily.supports_retract`` is False: which request the scheduler preempts, and how it
    frees it, is ``--family vllm``'s to run), no KV connector and no mamba "align" (declined by the factory)."""

    # --- helpers ---------------------------------------------------------------------------
    def _live(self, req: ReqKv, fam):
        live = fam.live.get(req.rid)
        if live is None:
            raise PoolError(f"req {req.rid} is unknown to the vllm family")
        return live

    def _sync(self, req: ReqKv, live) -> None:
        """vLLM's Request catches up with the harness: sampled tokens appended (their block hashes
        computed by the hasher), ``num_computed_tokens`` = the KV written."""
        request = live.request
        while request.num_tokens < req.seqlen:
            request.append_output_token_ids(token_id(req.rid, request.num_tokens))
        request.num_computed_tokens = req.kv_committed_len

    def _refresh(self, req: ReqKv, live, fam) -> None:
        """The request's lengths and slots as its block tables say now."""
        ps = fam.config.page_size
        swa = fam.block_ids(live, "swa")
        lead = 0
        while lead < len(swa) and swa[lead] == 0:
            lead += 1
        req.swa_evicted_seqlen = lead * ps
        mamba = [b for b in fam.block_ids(live, "mamba") if b]
        req.mamba_pool_idx = mamba[-1] if mamba else None  # mamba cache mode "none": one state block per request

    def _step(self, fam) -> None:
        starts = getattr(fam.manager, "new_step_starts", None)
        if starts is not None:
            starts()

    def _allocate(self, req: ReqKv, live, fam, new_tokens: int, **kw) -> None:
        out = fam.manager.allocate_slots(live.request, new_tokens, **kw)
        if out is None:
            raise PoolExhausted(space="full", requested=new_tokens,
                                available=fam.block_pool.get_num_free_blocks() * fam.config.page_size)

    # --- the lifecycle ---------------------------------------------------------------------
    def admit(self, req: ReqKv, fam) -> None:
        row = fam.rows.take()
        if row is None:
            raise PoolExhausted(space="rows", requested=1, available=0)
        api = fam.api
        request = api.new_request(str(req.rid), [token_id(req.rid, p) for p in range(req.seqlen)],
                                  fam.built.hash_block_size)
        live = LiveRequest(rid=req.rid, request=request, row=row)
        fam.live[req.rid] = live
        fam.by_row[row] = live
        req.req_pool_idx = row
        req.mamba_needs_clear = fam.config.has_mamba

    def extend(self, req: ReqKv, fam, new_len: int):
        live = self._live(req, fam)
        self._sync(req, live)
        if new_len <= req.kv_allocated_len:
            return None
        self._step(fam)
        before = fam.held_blocks()
        self._allocate(req, live, fam, new_len - req.kv_committed_len)
        req.kv_allocated_len = new_len
        self._refresh(req, live, fam)
        fam.report_frees(before)
        fam.end_of_schedule()
        return None

    def run_deferred_mamba_ops(self, reqs: list[ReqKv], fam) -> None:
        """A new request's first forward starts from no state (vLLM: ``has_initial_state`` False)."""
        for req in reqs:
            if req.mamba_needs_clear and req.mamba_pool_idx is not None:
                zero_rows(fam.req_pool.mamba_pool.components(), "mamba", req.mamba_pool_idx)
                req.mamba_needs_clear = False

    def free_speculative_tail(self, req: ReqKv, fam) -> None:
        """vLLM keeps the blocks of rejected draft tokens: the next tokens reuse them."""
        self._sync(req, self._live(req, fam))

    def evict_swa(self, req: ReqKv, fam, pre_len: int) -> None:
        live = self._live(req, fam)
        self._sync(req, live)
        before = fam.held_blocks()
        fam.manager.remove_skipped_blocks(live.request.request_id, pre_len)
        self._refresh(req, live, fam)
        fam.report_frees(before)
        fam.end_of_schedule()

    def _free(self, req: ReqKv, live, fam) -> None:
        """A finished request's blocks back to the pool (``free``, tail first), as a scheduler without a KV
        connector frees them."""
        before = fam.held_blocks()
        fam.manager.free(live.request)
        if live.row is not None:
            fam.by_row.pop(live.row, None)
            row, live.row = live.row, None
            fam.rows.give_back(row)
        fam.report_frees(before)
        fam.end_of_schedule()
        req.req_pool_idx = req.mamba_pool_idx = None
        req.kv_allocated_len = req.kv_committed_len = req.swa_evicted_seqlen = 0

    def retract(self, req: ReqKv, fam) -> None:
        raise PoolError("vllm:manager does not preempt (supports_retract is False): which request vLLM preempts and "
                        "how is its Scheduler's decision, run with --family vllm")

    def lookup(self, req: ReqKv, fam) -> dict:
        """What a next turn's prompt finds: the local prefix hit (``get_computed_blocks``), no external tokens."""
        live = self._live(req, fam)
        return self._lookup(live, fam)[1]

    def _lookup(self, live, fam):
        """``get_computed_blocks`` and the stats the scheduler records of it: the blocks and ``{"hit": tokens}``."""
        if not fam.prefix_caching:
            return None, {"hit": 0}
        m, request = fam.manager, live.request
        blocks, hit = m.get_computed_blocks(request)[:2]
        if hasattr(m, "record_prefix_cache_stats"):
            m.record_prefix_cache_stats(request, hit)
        return blocks, {"hit": hit}

    def resume(self, req: ReqKv, fam) -> None:
        """A next turn (``begin_turn``) allocated: its hit's blocks adopted and ``allocate_slots`` for every token
        up to the last sampled one, whose KV the harness then computes (from the hit on)."""
        live = self._live(req, fam)
        n = req.retraction_backup.num_tokens
        row = fam.rows.take()
        if row is None:
            raise PoolExhausted(space="rows", requested=1, available=0)
        request = live.request
        request.status = fam.api.RequestStatus.WAITING
        self._step(fam)
        blocks, found = self._lookup(live, fam)
        hit = found["hit"]
        kw = {}
        if hit:
            kw.update(num_new_computed_tokens=hit, new_computed_blocks=blocks)
        try:
            self._allocate(req, live, fam, n + 1 - hit, **kw)
        except PoolExhausted:
            fam.rows.give_back(row)
            raise
        request.status = fam.api.RequestStatus.RUNNING
        request.num_computed_tokens = n
        live.row = row
        fam.by_row[row] = live
        req.req_pool_idx = row
        req.kv_allocated_len = n + 1
        req.kv_committed_len = n
        req.mamba_pool_idx = None
        self._refresh(req, live, fam)
        fam.end_of_schedule()
        req.recompute_from = hit  # positions from the hit on are computed again
        req.retraction_backup = None

    def pre_alloc(self, req: ReqKv, fam, fill_len: int) -> None:
        raise PoolError("the vllm family does not drive PD transfers (supports_transfer is False)")

    def release_kv(self, req: ReqKv, fam) -> None:
        live = fam.live.pop(req.rid, None)
        if live is None:
            raise PoolError(f"req {req.rid} released twice")
        self._sync(req, live)
        fam.finished_tokens[req.rid] = list(live.request.all_token_ids)  # what a next turn continues
        self._free(req, live, fam)

    def abort(self, req: ReqKv, fam) -> None:
        self.release_kv(req, fam)

    def begin_turn(self, req: ReqKv, fam, *, src_rid: int, prefix: int) -> dict:
        """A finished request's next turn arrives: its first ``prefix`` tokens, then its own. ``resume`` then
        allocates it: the local prefix hit on the finished request's cached blocks, and every token up to the last."""
        tokens = fam.finished_tokens[src_rid][:prefix]
        tokens += [token_id(req.rid, p) for p in range(prefix, req.seqlen)]
        fam.live[req.rid] = LiveRequest(rid=req.rid, request=fam.api.new_request(str(req.rid), tokens,
                                                                                 fam.built.hash_block_size))
        req.retraction_backup = RetractionBackup(mode="cpu_tensor", num_tokens=req.seqlen - 1)
        return self.lookup(req, fam)

    def end_turn(self, req: ReqKv, fam) -> None:
        """The next turn did not fit: the scheduler drops it (it waits; the harness asks again later)."""
        fam.live.pop(req.rid, None)
        req.retraction_backup = None

    def fork(self, src: ReqKv, dst: ReqKv, family) -> None:
        raise PoolError("the vllm family does not drive forks (supports_fork is False)")
