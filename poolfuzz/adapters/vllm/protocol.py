"""The harness's request lifecycle on vLLM's KVCacheManager, in the scheduler's call order."""

from __future__ import annotations

from dataclasses import dataclass, field

from poolfuzz.adapters.vllm.compat import mamba_block_aligned_split
from poolfuzz.adapters.vllm.storage import copy_rows, zero_rows
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
    # align mode, set by a resume: (block, tokens, loaded) of the state it starts from (see cached_states)
    found_states: list = field(default_factory=list)


class VllmProtocol:
    """admit: a vLLM Request and an input-batch row; extend: ``allocate_slots``; retract: preemption
    (``free``, the KV is recomputed on resume); resume: prefix lookup, the tokens a KV connector
    reports (the request's full blocks it offloaded) and ``allocate_slots`` for the rest."""

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
        state = mamba[-1] if mamba else None
        if state is not None and req.mamba_pool_idx is not None and state != req.mamba_pool_idx \
                and not req.mamba_needs_clear:
            # The worker carries the running state into the request's newest state block.
            copy_rows(fam.req_pool.mamba_pool.components(), "mamba", req.mamba_pool_idx, state)
        req.mamba_pool_idx = state

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

    def prefill_chunk_end(self, req: ReqKv, fam, start: int, end: int, prompt_len: int) -> int:
        """Where vLLM's scheduler ends a prefill chunk of ``[start, end)``: with a mamba group in "align" mode,
        ``Scheduler._mamba_block_aligned_split`` itself decides, called on a server of this config
        (``scheduling.align_splitter``) with the request as the manager holds it. The worker writes the
        state only at a chunk's end and a block is cached with the state it holds, so where the chunk ends
        is the scheduler's decision, not the harness's. ``end <= start``: no chunk fits, it waits."""
        if fam.mamba_mode != "align" or start >= prompt_len:
            return end
        live = self._live(req, fam)
        self._sync(req, live)
        return start + mamba_block_aligned_split(fam.splitter, live.request, end - start)

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

    def _free(self, req: ReqKv, live, fam, *, finished: bool = False) -> None:
        before = fam.held_blocks()
        m = fam.manager
        if finished and hasattr(m, "pop_blocks_for_free"):
            # A finished request, as the scheduler frees it with a KV connector attached: the connector
            # is shown the request's blocks (window-skipped ones released first), then the blocks go
            # back through the deferred-free path (popped now, returned tail first once the step ran).
            request = live.request
            if hasattr(m, "finalize_partial_tail_offloads"):
                m.finalize_partial_tail_offloads(request)
            m.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
            if hasattr(m, "get_block_ids_for_computed_tokens"):
                m.get_block_ids_for_computed_tokens(request.request_id, request.num_computed_tokens)
            if hasattr(m, "estimate_cached_tokens"):
                m.estimate_cached_tokens(request)
            fam.block_pool.free_blocks(reversed(m.pop_blocks_for_free(request)))
        else:
            m.free(live.request)
        if live.row is not None:
            fam.by_row.pop(live.row, None)
            row, live.row = live.row, None
            fam.rows.give_back(row)
        fam.report_frees(before)
        fam.end_of_schedule()
        req.req_pool_idx = req.mamba_pool_idx = None
        req.kv_allocated_len = req.kv_committed_len = req.swa_evicted_seqlen = 0

    def retract(self, req: ReqKv, fam) -> None:
        """Preemption: every block back to the pool (cached ones stay hittable); nothing copied."""
        live = self._live(req, fam)
        self._sync(req, live)
        backed_up = req.seqlen - 1
        self._free(req, live, fam)
        live.request.status = fam.api.RequestStatus.PREEMPTED
        live.request.num_computed_tokens = 0
        req.retraction_backup = RetractionBackup(mode="cpu_tensor", num_tokens=backed_up)
        req.retraction_count += 1

    def lookup(self, req: ReqKv, fam) -> dict:
        """What the scheduler finds for a preempted request: its local prefix hit and the tokens after
        it that the KV connector holds (the request's whole blocks, offloaded at preemption), at most
        up to the last sampled token, whose KV is computed in the resume step."""
        live = self._live(req, fam)
        n = req.retraction_backup.num_tokens
        return self._lookup(live, fam, n)[1]

    def _lookup(self, live, fam, n: int):
        """The scheduler's lookup with a KV connector attached: the local hit (per group where the
        release reports diverging hybrid hits, reconciled when the connector backs none of it), then
        the connector's tokens after it."""
        if not fam.prefix_caching:
            return None, {"hit": 0, "external": 0}
        m, request = fam.manager, live.request
        by_connector = getattr(m, "get_computed_blocks_for_connector", None)
        diverged = False
        if by_connector is not None and fam.api.takes_external_tokens:
            found = by_connector(request)
            blocks, hit, diverged = found[0], found[1], found[3]
        else:
            found = m.get_computed_blocks(request)
            blocks, hit = found[0], found[1]
        if len(found) > 2 and hasattr(request, "shared_prefix_boundary"):
            # where the hit's shared prefix ends, kept on the request as the scheduler keeps it: its split
            # (prefill_chunk_end) stops a later chunk there
            request.shared_prefix_boundary = found[2]
        ps = fam.config.page_size
        external = 0
        if fam.api.takes_external_tokens:
            # The connector is shown the hit cut to a block boundary (a hit inside a block ends there)
            # and holds the request's whole blocks after it. As the scheduler takes it: past the
            # hit's tail inside its block, the load supersedes that tail (cut from the local hit, so
            # nothing is copied on write); else the local tail stays and nothing is loaded.
            tail = hit % ps
            external = max(0, n // ps * ps - (hit - tail))
            if tail and external > tail and hasattr(m, "truncate_computed_blocks"):
                blocks, hit = m.truncate_computed_blocks(blocks, hit - tail), hit - tail
            elif tail:
                external = 0
        if diverged and external == 0:
            found = m.get_computed_blocks(request)
            blocks, hit = found[0], found[1]
        if hasattr(m, "record_prefix_cache_stats"):
            m.record_prefix_cache_stats(request, hit)
        found = {"hit": hit, "external": external}
        if fam.mamba_mode == "align" and hit:
            # Whether the hit brings a cached state block: not where the load cut a hit inside a
            # block (the mamba group's hit is then null blocks only; the connector loads the state).
            mamba = blocks.blocks[fam.group_of["mamba"].index]
            found["hit_state"] = bool(mamba) and not mamba[-1].is_null
        return blocks, found

    def resume(self, req: ReqKv, fam) -> None:
        live = self._live(req, fam)
        n = req.retraction_backup.num_tokens
        row = fam.rows.take()
        if row is None:
            raise PoolExhausted(space="rows", requested=1, available=0)
        request = live.request
        request.status = fam.api.RequestStatus.WAITING
        self._step(fam)
        blocks, found = self._lookup(live, fam, n)
        hit, external = found["hit"], found["external"]
        kw = {}
        if hit:
            kw.update(num_new_computed_tokens=hit, new_computed_blocks=blocks)
        if external:
            kw["num_external_computed_tokens"] = external
        # Every token up to the last sampled one, as the scheduler schedules a resumed request; with
        # mamba "align", up to that token only (a step the token budget ends at the resumed prefill's
        # end, ``num_tokens - 1``): the resume step would compute the last token's state, which the
        # harness computes in the next decode, so that token's block is allocated (and cached) then.
        last = n + 1
        if fam.mamba_mode == "align":
            last = n if hit + external < n or fam.api.adopts_without_new_tokens else n + 1
            if last == n + 1 and "delay_cache_blocks" in fam.api.allocate_params:
                # Nothing before the last token is left to compute and this release refuses a step of
                # no new tokens: the last token's block is allocated now but cached by a later step,
                # once its state is there (vLLM's deferred caching, as for a KV load completing later).
                kw["delay_cache_blocks"] = True
        if "full_sequence_must_fit" in fam.api.allocate_params and last == n + 1:
            kw["full_sequence_must_fit"] = True  # a scheduler that reserves a waiting request's whole input
        try:
            self._allocate(req, live, fam, last - hit - external, **kw)
        except PoolExhausted:
            fam.rows.give_back(row)
            raise
        request.status = fam.api.RequestStatus.RUNNING
        request.num_computed_tokens = n
        live.row = row
        fam.by_row[row] = live
        req.req_pool_idx = row
        req.kv_allocated_len = last
        req.kv_committed_len = n
        req.mamba_pool_idx = None
        self._refresh(req, live, fam)
        fam.end_of_schedule()
        if fam.mamba_mode == "align" and (hit or external):
            # The state block the lookup ends on: the connector's (it loads the state after the last
            # external token into it) or the local hit's cached one (the state after the hit).
            ps, mamba = fam.config.page_size, fam.block_ids(live, "mamba")
            end = hit + external
            live.found_states = [(mamba[(end - 1) // ps], end, bool(external))]
        # Positions from the hit on are written again: by the connector's load, then the recompute.
        req.recompute_from = hit
        req.retraction_backup = None

    def cached_states(self, req: ReqKv, fam) -> list[tuple[int, int, bool]]:
        """The state blocks the last resume started from, once (``harness.state_hits``)."""
        live = self._live(req, fam)
        found, live.found_states = live.found_states, []
        return found

    def pre_alloc(self, req: ReqKv, fam, fill_len: int) -> None:
        raise PoolError("the vllm family does not drive PD transfers (supports_transfer is False)")

    def release_kv(self, req: ReqKv, fam) -> None:
        live = fam.live.pop(req.rid, None)
        if live is None:
            raise PoolError(f"req {req.rid} released twice")
        self._sync(req, live)
        fam.finished_tokens[req.rid] = list(live.request.all_token_ids)  # what a next turn continues
        if live.row is not None or live.request.status != fam.api.RequestStatus.PREEMPTED:
            self._free(req, live, fam, finished=True)

    def abort(self, req: ReqKv, fam) -> None:
        self.release_kv(req, fam)

    def begin_turn(self, req: ReqKv, fam, *, src_rid: int, prefix: int) -> dict:
        """A finished request's next turn arrives: its first ``prefix`` tokens, then its own. It is
        scheduled as a resumed request is (``resume``): the prefix hit, the connector's tokens (its
        whole blocks, as a PD decode node receives a prompt) and every token up to the last."""
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
