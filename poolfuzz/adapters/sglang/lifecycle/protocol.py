"""The request lifecycle on SGLang's real pools, in SGLang's call order, with SGLang's own code.

What runs is SGLang's: row and mamba-slot allocation (``HybridReqToTokenPool.alloc``), token
allocation (``alloc`` / ``alloc_extend`` / ``alloc_decode`` / ``alloc_extend_swa_tail``), SWA
window eviction (``free_swa_out_of_window_slots``), row release (``free_kv_row_segments``,
``free_mamba_cache``, ``ReqToTokenPool.free``), and the retraction backup and restore
(``Req.offload_kv_cache`` / ``Req.load_kv_cache``, borrowed onto a stand-in request; in host_pool mode
``mem_cache.common.backup_kv_cache`` / ``restore_kv_cache`` / ``discard_kv_cache_backup``, see
:mod:`poolfuzz.adapters.sglang.host_tier.host`). What the
adapter adds is the glue a scheduler would be: it calls them in ``release_req`` and
``_pre_alloc`` order, turns SGLang's ``None`` returns and asserts into poolfuzz's typed errors,
and mirrors ids into the harness's :class:`~poolfuzz.pools.request.ReqKv`.

CPU aliasing: on a CPU, ``tensor.to("cpu", non_blocking=True)`` returns the tensor itself, and
indexing with a 0-d slot tensor gives a view, so a CPU "backup" can alias the live slot it was
taken from; on a GPU the same call copies. The adapter copies any backup tensor that shares
storage with a live pool buffer right after SGLang's ``offload_kv_cache`` returns (before any
slot is released), records it in ``family.cpu_aliases``, and so reports what a GPU would do.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.lifecycle.admission import CHECK_DECODE_MEM, OverAdmitted
from poolfuzz.adapters.sglang.api import accepted_kwargs, parameters
from poolfuzz.adapters.sglang.pools.calls import paged_alloc_decode, paged_alloc_extend
from poolfuzz.adapters.sglang.lifecycle.frees import free_group, free_row_segment, release_row, scheduling_pass
from poolfuzz.adapters.sglang.shims import cpu_synchronize
from poolfuzz.adapters.sglang.disaggregation import prealloc
from poolfuzz.adapters.sglang.lifecycle import speculative, tracking
from poolfuzz.pools.errors import DoubleFree, PoolError, PoolExhausted
from poolfuzz.pools.protocol import ServingProtocol, floor_page, window_start
from poolfuzz.adapters.sglang.pools.views import mamba_state_tensors
from poolfuzz.pools.request import ReqKv, RetractionBackup


def unalias_backup(sg, family, rid: str) -> None:
    """The CPU trap (module docstring): copy every tensor of request ``sg``'s retraction backup that shares storage
    with one of ``family``'s live pool buffers, as a GPU's device-to-host copy gives the backup its own memory, and
    record each in ``family.cpu_aliases`` under ``rid``. Called right after SGLang's ``offload_kv_cache`` returns,
    before any of the request's slots is freed (the lifecycle path here, the scheduler path around ``retract_decode``)."""
    live = {_storage_ptr(c.tensor) for c in family.components()}  # the buffers SGLang reads
    hits: list[str] = []

    def fix(obj, path):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and _storage_ptr(obj) in live:
                hits.append(f"{path} {tuple(obj.shape)}")
                return obj.clone()
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(fix(v, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(fix(v, f"{path}[{i}]") for i, v in enumerate(obj))
        if isinstance(obj, dict):
            return {k: fix(v, f"{path}[{k!r}]") for k, v in obj.items()}
        return obj

    kv = getattr(sg, "kv", sg)  # 0.5.23 keeps the backup on req.kv
    for holder in (kv, sg):
        if getattr(holder, "retraction_backup", None) is not None:
            holder.retraction_backup = fix(holder.retraction_backup, "retraction_backup")
            break
        if getattr(holder, "kv_cache_cpu", None) is not None:
            holder.kv_cache_cpu = fix(holder.kv_cache_cpu, "kv_cache_cpu")
            break
    if hits:
        family.cpu_aliases.append((rid, tuple(hits)))


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SGLangProtocol(ServingProtocol):
    """SGLang's request-side memory operations on its real pools (see the module docstring)."""

    def __init__(self):
        self.standins: dict[int, object] = {}
        self.first_extend: set[int] = set()  # admitted requests whose first extend the prefill budget judges

    # --- stand-in requests ---------------------------------------------------------------------
    def standin(self, req: ReqKv, family):
        got = self.standins.get(req.rid)
        if got is None:
            got = family.standin_cls(rid=req.rid, api=family.api)
            self.standins[req.rid] = got
        got.seqlen = req.seqlen
        return got

    def _done(self, family) -> None:
        family.notify_frees()

    # --- token ids (a prefix tree keys by them) ----------------------------------------------------
    def token_ids(self, rid: int) -> list[int] | None:
        """The request's token ids as this node knows them; None: a node without a prefix tree keeps none."""
        return None

    def adopt_token_ids(self, rid: int, tokens: list[int]) -> None:
        """A request arriving from another node (PD) brings its token ids, as a decode server's request does;
        a node without a prefix tree has no use for them."""

    # --- admission -----------------------------------------------------------------------------
    def admit(self, req: ReqKv, family) -> None:
        try:
            self._alloc_row_and_mamba(req, family)
            req.mamba_needs_clear = req.mamba_pool_idx is not None
        finally:
            self._done(family)

    def _alloc_row_and_mamba(self, req: ReqKv, family, *, fill_len: int | None = None) -> None:
        sg = self.standin(req, family)
        kv = sg
        pool = family.sg_req_pool
        scheduling_pass(pool)  # the scheduler's pass over its waiting queue, before it binds rows
        family.admission.admit(family, sg)  # SGLang's own checks decide; nothing stricter here
        if fill_len is not None and family.pd_decode:  # the decode queue's pre-allocation gate, then _pre_alloc
            # a resume carries its retraction backup; a request arriving from the prefill node has none
            prealloc.check(family, fill_len, family.admission.tree_cache, arriving=req.retraction_backup is None)
        try:
            if family.api.row_alloc_takes_reqs:
                got = pool.alloc([sg])
            else:
                got = pool.alloc(1)
                if got is not None:
                    kv.req_pool_idx = got[0]
        except AssertionError as exc:
            # HybridReqToTokenPool asserts when mamba slots run out after it has taken the row.
            # SGLang's admission said it would fit: report what the pool did, row and all (the
            # harness then sees the row that was taken and never bound to a request).
            row = kv.req_pool_idx
            raise PoolError(f"SGLang's {type(pool).__name__}.alloc asserted after SGLang's admission checks "
                            f"passed (row {row} taken): {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if got is None:
            raise PoolExhausted(space="rows", requested=1, available=pool.available_size())
        if family.has_recurrent_state() and kv.mamba_pool_idx is None:
            self._alloc_mamba_flat(sg, family)
        req.req_pool_idx = int(kv.req_pool_idx)
        req.mamba_pool_idx = None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx)
        tracking.mirror(req, sg)  # extra-buffer mode: the track slots alloc gave it
        if fill_len is None:  # a resume's tokens pass the decode pre-allocation gate instead
            self.first_extend.add(req.rid)

    def _alloc_mamba_flat(self, sg, family) -> None:
        """Releases whose row allocation takes a count leave the mamba slot to the caller."""
        kv = sg
        pool = family.sg_req_pool
        owner = getattr(pool, "mamba_allocator", None) or pool.mamba_pool
        got = owner.alloc(1)
        if got is None:
            pool.free(kv.req_pool_idx)
            kv.req_pool_idx = None
            raise PoolExhausted(space="mamba", requested=1, available=owner.available_size())
        kv.mamba_pool_idx = got[0]
        pool.req_index_to_mamba_index_mapping[kv.req_pool_idx] = int(got[0])
        kv.mamba_needs_clear = True

    # --- token allocation -----------------------------------------------------------------------
    def extend(self, req: ReqKv, family, new_len: int) -> torch.Tensor:
        try:
            start = req.kv_allocated_len
            if new_len <= start:  # already allocated (the rest of a page kept after a speculative step)
                return torch.empty(0, dtype=torch.int64)
            last_loc = int(family.req_pool.req_to_token[req.req_pool_idx, start - 1]) if start else -1
            first = req.rid in self.first_extend
            budget = None
            if first and (new_len - start > 1 or start == 0):  # (one token past a hit takes the decode path)
                # judged before the tree evicts for it, as the adder judges before ``alloc_for_extend``
                budget = family.admission.prefill_admitted(family, prefix_len=start, seq_len=new_len)
            try:
                slots = self._alloc_tokens(family, prefix_len=start, seq_len=new_len, last_loc=last_loc,
                                           sg=self._synced(req, family), first=first)
            except PoolExhausted as exc:
                if budget is None:
                    raise  # still waiting: the adder asks its budget again when the request is retried
                self.first_extend.discard(req.rid)
                raise OverAdmitted(admitted_by=f"{budget}.check_prefill",
                                   what=f"a {new_len - start}-token extend (the request's first)",
                                   crash="Prefill out of memory", exhausted=exc) from exc
            self.first_extend.discard(req.rid)
            self._write_row(req, family, start, slots)
            req.kv_allocated_len = new_len
            self.standin(req, family).kv_allocated_len = new_len
            return slots
        finally:
            self._done(family)

    def free_speculative_tail(self, req: ReqKv, family) -> None:
        """After verify, SGLang frees the over-allocated tail of rejected drafts, keeping the page
        that holds the last committed token (``_release_overallocated_kv_indices``' alignment): a row
        segment from that page's end, whose own end may fall mid-page, inside the batch's free group."""
        try:
            ps = family.config.page_size
            keep = min(req.kv_allocated_len, -(-req.kv_committed_len // ps) * ps)
            if keep < req.kv_allocated_len:
                evicted = self._swa_evicted(self.standin(req, family), family) if family.config.has_swa else 0
                with free_group(family.sg_allocator):
                    free_row_segment(family, req.req_pool_idx, keep, req.kv_allocated_len, swa_evicted=evicted)
                req.kv_allocated_len = keep
                sg = self.standin(req, family)
                sg.kv_allocated_len = keep
        finally:
            self._done(family)

    def _needs(self, family, *, full_pages: int, swa_pages: int) -> dict[str, int]:
        needs = {"full": full_pages}
        if family.config.has_swa:
            needs["swa"] = swa_pages
        return needs

    def _synced(self, req: ReqKv, family):
        """The stand-in with the lengths SGLang's checks read, as the harness last set them."""
        sg = self.standin(req, family)
        sg.kv_committed_len = req.kv_committed_len
        sg.kv_allocated_len = req.kv_allocated_len
        return sg

    def _alloc_tokens(self, family, *, prefix_len: int, seq_len: int, last_loc: int, sg=None,
                      first: bool = False) -> torch.Tensor:
        """``first``: the request's first extend since admission, which SGLang schedules as a prefill even
        where it is one token past a prefix hit (and so takes the decode path here)."""
        ps = family.config.page_size
        n = seq_len - prefix_len
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        pages = -(-seq_len // ps) - (-(-prefix_len // ps))
        alloc = family.sg_allocator
        decode = sg is not None and n == 1 and prefix_len > 0
        if decode and not family.admission.decode_fits(family, sg, new_tokens=pages * ps):
            # ``check_decode_mem`` said no: the scheduler retracts before it allocates (and treats a
            # None from ``alloc_decode`` as fatal). Name the short space for the harness.
            short = family.space_short_of(self._needs(family, full_pages=max(pages, 1), swa_pages=max(pages, 1)))
            space, requested, available = short or ("full", ps, alloc.available_size())
            raise PoolExhausted(space=space, requested=requested, available=available)
        if ps == 1:
            out = alloc.alloc(n)
        elif n == 1 and prefix_len > 0:
            out = paged_alloc_decode(alloc, seq_len=seq_len, last_loc=last_loc)
        else:
            if pages and family.api.kernels_interpreted and family.api.paged_kernels:
                # These releases' alloc_extend launches its kernel before it counts the free pages: the
                # kernel reads past the free list, and the scheduler's prefill admission (its token budget)
                # is what keeps that from happening. On a GPU the stray read is harmless; interpreted on
                # the CPU it reads unmapped memory and kills the process. Check as the admission does.
                short = family.space_short_of(self._needs(family, full_pages=pages, swa_pages=pages))
                if short:
                    raise PoolExhausted(space=short[0], requested=short[1], available=short[2])
            out = paged_alloc_extend(alloc, prefix_len=prefix_len, seq_len=seq_len, last_loc=last_loc)
        if out is None:
            short = family.space_short_of(self._needs(family, full_pages=pages, swa_pages=pages))
            space, requested, available = short or ("full", pages * ps, alloc.available_size())
            exhausted = PoolExhausted(space=space, requested=requested, available=available)
            # a plain decode that SGLang's own check let through must be placed (asked only on this rare path)
            if decode and not first and family.admission.decode_gate(family, sg) == CHECK_DECODE_MEM:
                raise OverAdmitted(admitted_by=CHECK_DECODE_MEM, what="a one-token decode",
                                   crash="Decode out of memory", exhausted=exhausted)
            raise exhausted
        return out.to(device="cpu", dtype=torch.int64)

    def _write_row(self, req: ReqKv, family, start: int, slots: torch.Tensor) -> None:
        pool = family.sg_req_pool
        values = slots.to(device=pool.req_to_token.device, dtype=torch.int32)
        pool.write((req.req_pool_idx, slice(start, start + slots.numel())), values)

    def run_deferred_mamba_ops(self, reqs: list[ReqKv], family) -> None:
        """What SGLang's attention backend does on an extend forward with the flag that
        SGLang's own ``HybridReqToTokenPool.alloc`` set: clear the fresh slot."""
        if not family.has_recurrent_state():
            return
        pool = family.sg_req_pool.mamba_pool
        # the model runner translates the request's mamba slot to the state pool's physical one (the
        # unified pool's slots are virtual; identity elsewhere, absent before 0.5.23)
        translate = getattr(family.sg_req_pool, "translate_mamba_indices", lambda idx: idx)
        for req in reqs:
            kv = self.standin(req, family)
            if getattr(kv, "mamba_needs_clear", False) and kv.mamba_pool_idx is not None:
                idx = torch.as_tensor(kv.mamba_pool_idx).reshape(1).to(torch.int64)
                pool.clear_slots(translate(idx.to(_tensor_device(pool))))
            kv.mamba_needs_clear = False
            req.mamba_needs_clear = False

    # --- sliding window --------------------------------------------------------------------------
    def evict_swa(self, req: ReqKv, family, pre_len: int) -> None:
        if not family.config.has_swa:
            return
        try:
            with free_group(family.sg_allocator):  # maybe_evict_swa brackets its eviction pass
                self._evict_swa(req, family, pre_len)
        finally:
            self._done(family)

    def _evict_swa(self, req: ReqKv, family, pre_len: int) -> None:
        sg = self.standin(req, family)
        fn = family.api.free_swa_out_of_window_slots
        if fn is not None and "sliding_window_size" in parameters(fn):
            fn(sg, pre_len, **accepted_kwargs(
                fn, sliding_window_size=family.config.sliding_window, page_size=family.config.page_size,
                req_to_token_pool=family.sg_req_pool, token_to_kv_pool_allocator=family.sg_allocator,
                # the chunk-cache path (no prefix sharing), however this release spells it:
                # ScheduleBatch passes drop_page_margin=tree_cache.is_chunk_cache() where it exists
                supports_prefix_sharing=False, is_chunk_cache=True, drop_page_margin=True))
        else:
            self._evict_swa_by_hand(sg, family, pre_len)
        req.swa_evicted_seqlen = self._swa_evicted(sg, family)

    def _swa_evicted(self, sg, family) -> int:
        """The SWA eviction frontier: per component on ``req.kv`` (newer), else one field."""
        if hasattr(sg.kv, "get_evicted_seqlen") and family.api.ComponentType is not None:
            return int(sg.kv.get_evicted_seqlen(family.api.ComponentType.SWA))
        return int(getattr(sg, "swa_evicted_seqlen", 0) or 0)

    def _set_swa_evicted(self, sg, family, value: int) -> None:
        if hasattr(sg.kv, "set_evicted_seqlen") and family.api.ComponentType is not None:
            sg.kv.set_evicted_seqlen(family.api.ComponentType.SWA, value)
        else:
            sg.swa_evicted_seqlen = value

    def _evict_swa_by_hand(self, sg, family, pre_len: int) -> None:
        old = self._swa_evicted(sg, family)
        new = floor_page(max(old, pre_len - family.config.sliding_window), family.config.page_size)
        if new > old:
            family.sg_allocator.free_swa(family.sg_req_pool.req_to_token[sg.req_pool_idx, old:new])
            self._set_swa_evicted(sg, family, new)

    # --- release -----------------------------------------------------------------------------------
    def release_kv(self, req: ReqKv, family) -> None:
        """A finish or an abort: ``process_batch_result_*`` releases inside the batch's free group."""
        try:
            with free_group(family.sg_allocator):
                self._release(req, family)
        finally:
            self._done(family)

    def _release(self, req: ReqKv, family) -> None:
        """``release_kv_cache`` of a chunk cache: the KV row, then the mamba slot, then the row."""
        sg = self.standin(req, family)
        kv = sg
        if kv.req_pool_idx is None:
            raise DoubleFree(space="rows", slot=-1)
        row = kv.req_pool_idx
        allocated = kv.kv_allocated_len
        if allocated:
            evicted = self._swa_evicted(sg, family) if family.config.has_swa else 0
            release_row(family, row, committed=req.kv_committed_len, allocated=allocated, swa_evicted=evicted)
        if kv.mamba_pool_idx is not None:
            try:
                if hasattr(family.sg_req_pool, "free_mamba_cache"):
                    family.sg_req_pool.free_mamba_cache(sg)
                else:
                    owner = family.sg_req_pool.mamba_pool
                    owner.free(torch.as_tensor(kv.mamba_pool_idx).reshape(1))
                    kv.mamba_pool_idx = None
            except AssertionError as exc:
                raise DoubleFree(space="mamba", slot=-1) from exc
        try:
            if family.api.row_alloc_takes_reqs:
                family.sg_req_pool.free(sg)
            else:
                family.sg_req_pool.free(row)
                kv.req_pool_idx = None
        except AssertionError as exc:
            raise DoubleFree(space="rows", slot=int(row)) from exc
        kv.req_pool_idx = None
        kv.mamba_pool_idx = None
        kv.kv_allocated_len = kv.kv_committed_len = 0
        self._set_swa_evicted(sg, family, 0)
        sg.release_kv_record()
        req.req_pool_idx = req.mamba_pool_idx = None
        req.kv_allocated_len = req.kv_committed_len = 0
        tracking.mirror(req, sg)  # free_mamba_cache freed the track slots too

    def next_track_slot(self, req: ReqKv, family) -> int | None:
        """Extra-buffer mode: the slot ``mamba_next_track_idx`` names, then the scheduler's turn-taking."""
        if not req.mamba_track:
            return None
        return tracking.next_slot(req, self.standin(req, family), family.sg_req_pool)

    def move_accepted(self, req: ReqKv, family, *, tgt: torch.Tensor, src: torch.Tensor) -> None:
        speculative.move_accepted(family, tgt=tgt, src=src)

    def commit_speculative(self, req: ReqKv, family, *, accepted_step: int, drafted_steps: int,
                           track_slot: int | None) -> None:
        """After verify: SGLang's commit scatter from the request's scratch row (see adapters.sglang.speculative)."""
        speculative.commit(family.sg_req_pool, row=req.req_pool_idx, accepted_step=accepted_step,
                           state_slot=req.mamba_pool_idx, track_slot=track_slot)

    # --- retraction (SGLang's release_req order: back up, release, reset) -------------------------
    def retract(self, req: ReqKv, family) -> None:
        try:
            sg = self.standin(req, family)
            kv = sg
            kv.kv_committed_len = req.kv_committed_len
            if family.host_backup is not None:  # SGLang's host_pool backend (adapters.sglang.host)
                req.retraction_backup = family.host_backup.backup(sg, req.seqlen - 1)
            else:
                with cpu_synchronize(family.device):
                    sg.offload_kv_cache(family.sg_req_pool, family.sg_allocator)
                unalias_backup(sg, family, req.rid)
                req.retraction_backup = self._harness_backup(sg, req.seqlen - 1)
            self._release(req, family)
            self.reset_for_retract(req)
            sg.is_retracted = True
            sg.retraction_count += 1
            for name in ("mamba_cow_src_index", "mamba_ping_pong_track_buffer"):
                if hasattr(kv, name):
                    setattr(kv, name, None)
            kv.mamba_needs_clear = False
        finally:
            self._done(family)

    @staticmethod
    def _sglang_backup(sg):
        kv = sg
        backup = getattr(kv, "retraction_backup", None)
        if backup is None:
            backup = getattr(sg, "kv_cache_cpu", None)
        return backup

    def _harness_backup(self, sg, num_tokens: int) -> RetractionBackup:
        backup = self._sglang_backup(sg)
        cpu = getattr(backup, "cpu_tensors", backup)
        mamba_cpu = getattr(backup, "mamba_cpu", None)
        return RetractionBackup(mode="cpu_tensor", num_tokens=num_tokens, cpu_tensors=cpu, mamba_cpu=mamba_cpu)

    def discard(self, req: ReqKv, family) -> None:
        sg = self.standins.get(req.rid)
        if sg is not None and family.host_backup is not None:
            try:
                family.host_backup.discard(sg)
            finally:
                self._done(family)
        elif sg is not None:
            kv = sg
            if hasattr(kv, "retraction_backup"):
                kv.retraction_backup = None
            if hasattr(sg, "kv_cache_cpu"):
                sg.kv_cache_cpu = None
        req.retraction_backup = None

    # --- resume (``_pre_alloc``, then the load) --------------------------------------------------
    def pre_alloc(self, req: ReqKv, family, fill_len: int) -> None:
        try:
            self._pre_alloc(req, family, fill_len)
        finally:
            self._done(family)

    def _pre_alloc(self, req: ReqKv, family, fill_len: int) -> None:
        cfg = family.config
        ps = cfg.page_size
        sg = self.standin(req, family)
        kv = sg
        self._alloc_row_and_mamba(req, family, fill_len=fill_len)
        alloc = family.sg_allocator
        try:
            tail = None
            if cfg.has_swa and ps > 1 and family.resume_swa_tail_only:
                tail = fill_len - window_start(cfg, fill_len)
                full_pages, swa_pages = -(-fill_len // ps), -(-tail // ps)
                out = paged_alloc_extend(alloc, prefix_len=0, seq_len=fill_len, last_loc=-1, swa_tail_len=tail)
                if out is None:
                    short = family.space_short_of(self._needs(family, full_pages=full_pages, swa_pages=swa_pages))
                    space, requested, available = short or ("full", full_pages * ps, alloc.available_size())
                    raise PoolExhausted(space=space, requested=requested, available=available)
                slots = out.to(device="cpu", dtype=torch.int64)
            else:
                slots = self._alloc_tokens(family, prefix_len=0, seq_len=fill_len, last_loc=-1)
        except PoolError:
            self._undo_admit(sg, family)
            req.req_pool_idx = req.mamba_pool_idx = None
            tracking.mirror(req, sg)
            req.mamba_needs_clear = False
            raise
        self._write_row(req, family, 0, slots)
        evicted = fill_len - tail if tail is not None else 0
        self._set_swa_evicted(sg, family, evicted)
        req.swa_evicted_seqlen = evicted
        kv.kv_allocated_len = kv.kv_committed_len = fill_len
        req.kv_allocated_len = req.kv_committed_len = fill_len
        # SGLang's alloc flagged the new slot for clearing, but a resumed request runs decode
        # forwards only, which never clear: the state must come from the backup.
        req.mamba_needs_clear = False

    def _undo_admit(self, sg, family) -> None:
        kv = sg
        if kv.mamba_pool_idx is not None:
            if hasattr(family.sg_req_pool, "free_mamba_cache"):
                family.sg_req_pool.free_mamba_cache(sg)
            else:
                family.sg_req_pool.mamba_pool.free(torch.as_tensor(kv.mamba_pool_idx).reshape(1))
                kv.mamba_pool_idx = None
        if family.api.row_alloc_takes_reqs:
            family.sg_req_pool.free(sg)
        else:
            family.sg_req_pool.free(kv.req_pool_idx)
            kv.req_pool_idx = None
        kv.mamba_needs_clear = False

    def restore(self, req: ReqKv, family) -> None:
        sg = self.standin(req, family)
        sg.seqlen = req.retraction_backup.num_tokens + 1
        try:
            if family.host_backup is not None:
                family.host_backup.restore(sg)
            else:
                with cpu_synchronize(family.device):
                    sg.load_kv_cache(family.sg_req_pool, family.sg_allocator)
        except AssertionError as exc:
            raise PoolError(f"SGLang's {'restore_kv_cache' if family.host_backup else 'load_kv_cache'} "
                            f"asserted: {exc}") from exc
        finally:
            self._done(family)
        if hasattr(sg, "kv_cache_cpu"):
            sg.kv_cache_cpu = None
        req.retraction_backup = None

    # --- not driven on SGLang -----------------------------------------------------------------------
    def fork(self, src: ReqKv, dst: ReqKv, family) -> None:
        raise NotImplementedError("the sglang family does not drive radix prefix sharing (supports_fork = False)")


def _tensor_device(mamba_pool) -> torch.device:
    return mamba_state_tensors(mamba_pool)[1].device
