"""The request lifecycle over a family, in SGLang's call order: admit, extend, evict, retract, resume."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from poolfuzz.pools.errors import PoolError, PoolExhausted, UnsupportedBackup
from poolfuzz.pools.mamba import MambaPool
from poolfuzz.pools.request import HostTransfer, ReqKv, RetractionBackup

if TYPE_CHECKING:
    from poolfuzz.pools.interface import PoolFamilyInterface as PoolFamily


def floor_page(n: int, ps: int) -> int:
    return n // ps * ps


def ceil_page(n: int, ps: int) -> int:
    return -(-n // ps) * ps


def window_start(config, seq_len: int) -> int:
    """The first position whose SWA KV a request of ``seq_len`` tokens keeps: the window, widened
    back to a page boundary. Host backups, resumes (the SWA tail) and PD transfer all cover this."""
    return floor_page(max(0, seq_len - config.sliding_window), config.page_size)


@contextmanager
def free_group(allocator):
    """The frees inside go back together at the end (the scheduler's ``free_group_begin`` / ``_end``
    around a batch's frees), where the allocator keeps groups."""
    begin = getattr(allocator, "free_group_begin", None)
    if begin is None:
        yield
        return
    begin()
    try:
        yield
    finally:
        allocator.free_group_end()


def page_expand(tokens: torch.Tensor, ps: int) -> torch.Tensor:
    """All slots of the pages these slots lie on, pages in first-seen order."""
    if ps == 1 or tokens.numel() == 0:
        return tokens
    pages = tokens[::ps] // ps  # valid: the ranges expanded here start on a page boundary
    return (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)


class ServingProtocol:
    """SGLang's request-side memory operations (post-#35957), one method per call site.

    Faults in the catalogue subclass this and override one method, so the correct code and
    each historical bug read side by side.
    """

    # --- admission and prefill -------------------------------------------------------------
    def admit(self, req: ReqKv, family: PoolFamily) -> None:
        """A request row and, for recurrent-state models, a fresh mamba slot flagged for clearing
        (evicting an unlocked prefix-cache checkpoint first if none is free: ``ensure_mamba_capacity``)."""
        req.req_pool_idx = family.req_pool.alloc()
        if family.req_pool.mamba_pool is not None:
            try:
                # Admission counts the state slot and its track slots together, as the scheduler's
                # mamba budget does (get_mamba_tracking_slots): one request, one decision; the prefix
                # tree gives up unlocked checkpoints first (ensure_mamba_capacity)
                need = 1 + family.config.mamba_track_slots
                family.prefix_tree.ensure_free(need)
                have = family.req_pool.mamba_allocator.available_size()
                if need > 1 and need > have:
                    raise PoolExhausted(space="mamba", requested=need, available=have)
                req.mamba_pool_idx = family.req_pool.alloc_mamba(req.req_pool_idx)
                self.alloc_track_slots(req, family)
            except PoolError:
                if req.mamba_pool_idx is not None:
                    family.req_pool.free_mamba(req.req_pool_idx, req.mamba_pool_idx)
                    req.mamba_pool_idx = None
                family.req_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
                raise
            req.mamba_needs_clear = True

    # --- extra-buffer mode: track slots beside the state slot ----------------------------------
    def alloc_track_slots(self, req: ReqKv, family: PoolFamily) -> None:
        """The request's ping-pong track slots (SGLang's ``_alloc_ping_pong_buffer``), all or none."""
        n = family.config.mamba_track_slots
        alloc = family.req_pool.mamba_allocator
        taken: list[int] = []
        try:
            for _ in range(n):
                taken.append(alloc.alloc_one())
        except PoolError:
            if taken:
                alloc.free(taken)
            raise
        req.mamba_track = tuple(taken)
        req.track_writes = 0

    def free_track_slots(self, req: ReqKv, family: PoolFamily) -> None:
        if req.mamba_track:
            family.req_pool.mamba_allocator.free(list(req.mamba_track))
        req.mamba_track = ()
        req.track_writes = 0

    def next_track_slot(self, req: ReqKv, family: PoolFamily) -> int | None:
        """Where this forward also writes the state it leaves: the track slots in turn, so with the
        overlap schedule the slot the previous step wrote is not overwritten while it may be read."""
        if not req.mamba_track:
            return None
        slot = req.mamba_track[req.track_writes % len(req.mamba_track)]
        req.track_writes += 1
        return slot

    def commit_speculative(self, req: ReqKv, family: PoolFamily, *, accepted_step: int, drafted_steps: int,
                           track_slot: int | None) -> None:
        """After verify (``update_mamba_state_after_mtp_verify``): the state after the last accepted token,
        read from the request's scratch row, becomes its state (and its track slot's)."""
        family.req_pool.mamba_pool.spec_scratch.commit(
            row=req.req_pool_idx, accepted_step=accepted_step, drafted_steps=drafted_steps,
            state_slot=req.mamba_pool_idx, track_slot=track_slot)

    def extend(self, req: ReqKv, family: PoolFamily, new_len: int) -> torch.Tensor:
        """KV slots for positions ``[kv_allocated_len, new_len)``, written into the request row."""
        start = req.kv_allocated_len
        if new_len <= start:  # already allocated (the rest of a page kept after a speculative step)
            return torch.empty(0, dtype=torch.int64)
        last_loc = int(family.req_pool.req_to_token[req.req_pool_idx, start - 1]) if start else -1
        slots = family.allocator.alloc_extend(prefix_len=start, seq_len=new_len, last_loc=last_loc)
        family.req_pool.write(req.req_pool_idx, start, slots)
        req.kv_allocated_len = new_len
        return slots

    def free_speculative_tail(self, req: ReqKv, family: PoolFamily) -> None:
        """After verify, free the slots of rejected draft tokens — whole pages only: the page
        holding the last committed token stays, with its spare slots, for the next steps."""
        keep = min(req.kv_allocated_len, ceil_page(req.kv_committed_len, family.config.page_size))
        if keep < req.kv_allocated_len:
            with free_group(family.allocator):  # released with the batch's results
                family.allocator.free(family.req_pool.read(req.req_pool_idx, keep, req.kv_allocated_len))
            req.kv_allocated_len = keep

    def move_accepted(self, req: ReqKv, family: PoolFamily, *, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """After a tree verify (``move_accept_tokens_to_target_kvcache``): the accepted path's rows, every
        KV component, from their tree nodes' slots to the front of the request's verify window."""
        family.kv_pool.move_kv_cache(tgt, src)

    def run_deferred_mamba_ops(self, reqs: list[ReqKv], family: PoolFamily) -> None:
        """On an extend forward only: copy-on-write sources first (then the tree node is unlocked:
        it stays cached), else clear fresh slots."""
        pool = family.req_pool.mamba_pool
        if pool is None:
            return
        for req in reqs:
            if req.mamba_cow_src is not None:
                pool.copy_from([req.mamba_cow_src], [req.mamba_pool_idx])
                self.unlock_cow_source(req, family)
            elif req.mamba_needs_clear:
                pool.clear_slots([req.mamba_pool_idx])
            req.mamba_cow_src = None
            req.mamba_needs_clear = False

    def unlock_cow_source(self, req: ReqKv, family: PoolFamily) -> None:
        """``dec_lock_ref`` of the tree node a pending copy-on-write reads from."""
        node = family.prefix_tree.node_of_slot(req.mamba_cow_src)
        if node is not None:  # (a node evicted under the lock is the content checks' to catch)
            family.prefix_tree.dec_lock(node)
        req.mamba_cow_src = None

    def fork(self, src: ReqKv, dst: ReqKv, family: PoolFamily) -> None:
        """A new request matching ``src``'s committed tokens as a cached prefix (radix match).

        The prefix KV is copied into the new request's own slots (our stand-in for shared
        pages). The recurrent state comes from the prefix tree: a node checkpointing ``src`` at
        this length is matched and locked, or a checkpoint is taken now into a new tree slot and
        inserted; the new request's first extend forward copies it (copy-on-write) and unlocks it.
        """
        prefix = src.kv_committed_len
        tree = family.prefix_tree
        node = tree.match((src.rid, prefix)) if tree is not None else None
        if node is not None:
            tree.inc_lock(node)  # before admission evicts: a matched node is safe
        checkpoint = None
        try:
            self.admit(dst, family)
            if tree is not None and node is None:
                checkpoint = tree.alloc_slot()
            slots = self.extend(dst, family, prefix)
        except PoolError:
            if node is not None:
                tree.dec_lock(node)
            if checkpoint is not None:
                family.req_pool.mamba_allocator.free([checkpoint])
            if dst.req_pool_idx is not None:
                self.release_kv(dst, family)
            raise
        if tree is not None:
            if node is None:
                family.req_pool.mamba_pool.copy_from([src.mamba_pool_idx], [checkpoint])
                node = tree.insert((src.rid, prefix), checkpoint)
                tree.inc_lock(node)
            dst.mamba_cow_src = node.slot
            dst.mamba_needs_clear = False
        src_slots = family.req_pool.read(src.req_pool_idx, 0, prefix)
        family.copy_kv_rows(src_slots, slots)
        dst.kv_committed_len = prefix
        if family.config.has_swa:
            # Positions the source had evicted are outside the new request's window too.
            self.evict_swa(dst, family, prefix)

    # --- sliding window ----------------------------------------------------------------------
    def evict_swa(self, req: ReqKv, family: PoolFamily, pre_len: int) -> None:
        """Free SWA slots of positions that slid out of the window (chunk-cache threshold)."""
        if not family.config.has_swa:
            return
        window = family.config.sliding_window
        ps = family.config.page_size
        new = floor_page(max(req.swa_evicted_seqlen, pre_len - window), ps)
        if new > req.swa_evicted_seqlen:
            with free_group(family.allocator):  # maybe_evict_swa's eviction pass
                family.allocator.free_swa(family.req_pool.read(req.req_pool_idx, req.swa_evicted_seqlen, new))
            req.swa_evicted_seqlen = new

    # --- release -------------------------------------------------------------------------------
    def finish(self, req: ReqKv, family: PoolFamily) -> None:
        """A finished request's release: with the batch's results, inside its free group (a
        retraction releases outside any group)."""
        with free_group(family.allocator):
            self.release_kv(req, family)

    def release_kv(self, req: ReqKv, family: PoolFamily) -> None:
        """Free KV (full and SWA peers), then the mamba slot, then the row."""
        row = req.req_pool_idx
        start = self.release_start(req, family)
        if req.kv_allocated_len > start:
            family.allocator.free(family.req_pool.read(row, start, req.kv_allocated_len))
        if req.mamba_pool_idx is not None:
            family.req_pool.free_mamba(row, req.mamba_pool_idx)
        self.free_track_slots(req, family)
        if req.mamba_cow_src is not None:  # a copy-on-write that never ran: unlock its tree node
            self.unlock_cow_source(req, family)
        family.req_pool.free(row)
        req.req_pool_idx = None
        req.mamba_pool_idx = None
        req.kv_allocated_len = req.kv_committed_len = 0

    def release_start(self, req: ReqKv, family: PoolFamily) -> int:
        """The first position whose slot a release frees: 0, or, where the token slots are the window's own
        (an all-SWA model, ``allocator.window_only``), the first one the window has not evicted
        (SGLang's ``swa_dead_lo``)."""
        return req.swa_evicted_seqlen if getattr(family.allocator, "window_only", False) else 0

    def reset_for_retract(self, req: ReqKv) -> None:
        req.retraction_count += 1
        req.mamba_pool_idx = None
        req.mamba_cow_src = None
        req.mamba_needs_clear = False
        req.mamba_track = ()
        req.track_writes = 0
        req.kv_allocated_len = req.kv_committed_len = 0
        req.swa_evicted_seqlen = 0

    # --- retraction backup --------------------------------------------------------------------
    def mamba_pool_needing_backup(self, req: ReqKv, family: PoolFamily) -> MambaPool | None:
        """The pool whose state the caller must back up: only when the KV pool leaves it behind."""
        if req.mamba_pool_idx is None:
            return None
        if family.kv_pool.cpu_copy_carries_mamba:
            return None
        return family.req_pool.mamba_pool

    def backup_tokens(self, req: ReqKv) -> int:
        """The seqlen-1 contract: the last sampled token has no KV yet."""
        return req.seqlen - 1

    def offload_kv_cache(self, req: ReqKv, family: PoolFamily) -> RetractionBackup:
        n = self.backup_tokens(req)
        tokens = family.req_pool.read(req.req_pool_idx, 0, n)
        mamba_pool = self.mamba_pool_needing_backup(req, family)
        slot = None if req.mamba_pool_idx is None else torch.tensor([req.mamba_pool_idx])
        return RetractionBackup(
            mode="cpu_tensor",
            num_tokens=n,
            cpu_tensors=family.kv_pool.get_cpu_copy(tokens, mamba_indices=slot),
            mamba_cpu=None if mamba_pool is None else mamba_pool.get_cpu_copy(slot),
        )

    def host_pool_backup(self, req: ReqKv, family: PoolFamily) -> RetractionBackup:
        """KV of ``[0, n)`` padded to pages, SWA of the window; raises PoolExhausted("host")."""
        n = self.backup_tokens(req)
        ps = family.config.page_size
        plan = self._host_plan(req, family, n)
        needed = {space: ceil_page(len(pos), ps) for space, pos in plan.items()}
        for space, count in needed.items():
            host = family.host_pools[space]
            if count > host.available_size():
                raise PoolExhausted(space=space, requested=count, available=host.available_size())
        transfers = []
        for space, (first, tokens) in self._host_sources(req, family, plan).items():
            host = family.host_pools[space]
            dev = page_expand(tokens, ps)
            host_idx = host.alloc(dev.numel())
            host.backup_from_device(family.host_device_pool(space), host_idx, dev)
            transfers.append(HostTransfer(space=space, host_indices=host_idx, first_position=first,
                                          num_tokens=tokens.numel()))
        return RetractionBackup(mode="host_pool", num_tokens=n, host_transfers=tuple(transfers))

    def _host_plan(self, req: ReqKv, family: PoolFamily, n: int) -> dict[str, range]:
        plan = {"host.full": range(0, n)}
        if family.config.has_swa:
            plan["host.swa"] = range(window_start(family.config, n), n)
        return plan

    def _host_sources(self, req, family, plan) -> dict[str, tuple[int, torch.Tensor]]:
        out = {}
        for space, positions in plan.items():
            tokens = family.req_pool.read(req.req_pool_idx, positions.start, positions.stop)
            if space == "host.swa":
                tokens = family.allocator.translate(tokens)
                if bool((tokens <= 0).any()):
                    raise UnsupportedBackup(
                        f"{req}: SWA window positions {positions.start}..{positions.stop} are not all mapped"
                    )
            out[space] = (positions.start, tokens)
        return out

    def backup(self, req: ReqKv, family: PoolFamily) -> RetractionBackup:
        if family.backup_mode == "host_pool":
            return self.host_pool_backup(req, family)
        return self.offload_kv_cache(req, family)

    def retract(self, req: ReqKv, family: PoolFamily) -> None:
        """Back up while the request still owns its slots, then release everything.

        A host_pool backup that does not fit raises PoolExhausted before anything is released;
        the caller then aborts the request (SGLang: ``retraction_backup`` returns False).
        """
        req.retraction_backup = self.backup(req, family)
        self.release_kv(req, family)
        self.reset_for_retract(req)

    def abort(self, req: ReqKv, family: PoolFamily) -> None:
        """FINISH_ABORT: a live request releases everything; a retracted one drops its backup."""
        if req.req_pool_idx is None:
            self.discard(req, family)
        else:  # a live request (between two prefill chunks): released as a finish is
            self.finish(req, family)

    def discard(self, req: ReqKv, family: PoolFamily) -> None:
        """Abort of a retracted request: drop the backup and free any host slots it holds."""
        backup = req.retraction_backup
        req.retraction_backup = None
        if backup is not None:
            for t in backup.host_transfers:
                family.host_pools[t.space].free(t.host_indices)

    # --- resume ----------------------------------------------------------------------------------
    def pre_alloc(self, req: ReqKv, family: PoolFamily, fill_len: int) -> None:
        """New row, new (uncleared) mamba slot, and KV for ``[0, fill_len)``; all or nothing.

        With SWA and page size > 1 only the window tail gets SWA slots (SGLang's
        ``alloc_extend_swa_tail``); the positions before it count as already evicted.
        """
        self.admit(req, family)
        cfg = family.config
        try:
            if cfg.has_swa and cfg.page_size > 1:
                tail = fill_len - window_start(cfg, fill_len)
                slots = family.allocator.alloc_extend_swa_tail(seq_len=fill_len, swa_tail_len=tail)
                req.swa_evicted_seqlen = fill_len - tail
            else:  # swa_evicted_seqlen was reset by reset_for_retract (or is 0 on a new request)
                slots = family.allocator.alloc_extend(prefix_len=0, seq_len=fill_len, last_loc=-1)
        except PoolError:
            if req.mamba_pool_idx is not None:
                family.req_pool.free_mamba(req.req_pool_idx, req.mamba_pool_idx)
            self.free_track_slots(req, family)
            family.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = req.mamba_pool_idx = None
            req.mamba_needs_clear = False
            raise
        family.req_pool.write(req.req_pool_idx, 0, slots)
        req.kv_allocated_len = req.kv_committed_len = fill_len

    def restore(self, req: ReqKv, family: PoolFamily) -> None:
        """Load the backup into the newly allocated rows and slots, then drop it."""
        backup = req.retraction_backup
        assert backup is not None, f"{req} has no retraction backup to restore"
        if backup.mode == "host_pool":
            self._host_restore(req, family, backup)
        else:
            self.load_kv_cache(req, family, backup)
        req.retraction_backup = None

    def load_kv_cache(self, req: ReqKv, family: PoolFamily, backup: RetractionBackup) -> None:
        tokens = family.req_pool.read(req.req_pool_idx, 0, backup.num_tokens)
        slot = None if req.mamba_pool_idx is None else torch.tensor([req.mamba_pool_idx])
        if backup.mamba_cpu is not None and slot is not None:
            family.req_pool.mamba_pool.load_cpu_copy(backup.mamba_cpu, slot)
        family.kv_pool.load_cpu_copy(backup.cpu_tensors, tokens, mamba_indices=slot)

    def _host_restore(self, req: ReqKv, family: PoolFamily, backup: RetractionBackup) -> None:
        ps = family.config.page_size
        for t in backup.host_transfers:
            tokens = family.req_pool.read(req.req_pool_idx, t.first_position, t.first_position + t.num_tokens)
            if t.space == "host.swa":
                tokens = family.allocator.translate(tokens)
            dev = page_expand(tokens, ps)
            assert dev.numel() == t.host_indices.numel(), "host restore: length differs from the backup"
            host = family.host_pools[t.space]
            host.load_to_device(family.host_device_pool(t.space), t.host_indices, dev)
            host.free(t.host_indices)

    def resume(self, req: ReqKv, family: PoolFamily) -> None:
        """Re-admit a retracted request (``_pre_alloc``) and restore its backup."""
        fill_len = req.retraction_backup.num_tokens
        self.pre_alloc(req, family, fill_len)
        self.restore(req, family)
