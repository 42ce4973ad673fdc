"""Fork and prefix sharing through SGLang's own prefix tree, called as its scheduler calls it.

The tree is the one the installed release's scheduler would build for the model: its registry's
``default_radix_cache_factory`` (on 0.5.23 a ``UnifiedRadixCache`` with a FULL component for an
MHA-like model). The requests the tree sees are real ``Req`` objects (a subclass that also answers
the adapter's flat field names), and what runs on them is SGLang's own scheduler glue from
``mem_cache/common.py``:

* admission of a new request, and of a fork: ``match_kv_cache`` (the radix match), then
  ``tree_cache.lock(req.last_node)`` as ``PrefillAdder`` does; a fork's row starts with the matched
  prefix's slots (shared with the tree, which holds them) and its unmatched tokens are recomputed;
* every allocation first evicts what SGLang's allocation helpers evict (``evict_from_tree_cache``
  with their demand); a decode step's check is ``check_decode_mem`` over the tree;
* after each prefill forward: ``checkpoint_kv_cache`` (insert, dedupe, move the lock);
* finish: ``release_kv_cache(checkpoint=True)``; abort and retraction: ``checkpoint=False`` (a
  retraction then evicts as ``release_req`` does);
* an idle node's flush: ``tree_cache.evict``.

Tokens are traceable too: position ``p`` of request ``r`` is token ``r << 20 | p``, and a fork's
prompt starts with its source's tokens, so only a fork (never two unrelated requests) can hit.
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import fields

import torch

from poolfuzz.adapters.sglang.lifecycle.family import SGLangFamily
from poolfuzz.adapters.sglang.lifecycle.frees import free_group
from poolfuzz.adapters.sglang.lifecycle.protocol import SGLangProtocol
from poolfuzz.adapters.sglang.lifecycle.standin import FLAT_FIELDS
from poolfuzz.adapters.sglang.host_tier import hicache, l3
from poolfuzz.adapters.sglang.tree import idle_check, tree_swa
from poolfuzz.adapters.sglang.server_args import publish_defaults
from poolfuzz.adapters.sglang.tree.tree_build import build_tree, mamba_sized
from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.protocol import window_start

TOKEN_SHIFT = 20  # position bits of a traceable token id


def token_of(rid: int, position: int) -> int:
    return rid << TOKEN_SHIFT | position


def tree_problem(api, config) -> str | None:
    """Why forks do not go through SGLang's tree for ``config`` here, or None."""
    if _common() is None:
        return (f"SGLang {api.version} has no mem_cache.common.match_kv_cache / checkpoint_kv_cache / "
                "release_kv_cache (the scheduler glue the adapter calls)")
    if config.has_mamba and (config.page_size > 1 or config.mamba_track_slots):
        # SGLang's MambaComponent asserts page_size 1 without the extra buffer; the extra buffer's
        # checkpoints need the scheduler's track-seqlen bookkeeping (prepare_for_extend), not driven
        return ("the tree's mamba component is driven at page size 1 without the extra buffer only "
                "(paged or extra-buffer checkpoints need the scheduler's mamba track bookkeeping)")
    return None


def tree_sized(api, config):
    """The config as SGLang sizes it (a server sized by its memory: ``server_sized``), with the mamba slots its
    server's radix cache needs for the config's request rows (``mamba_sized``, by the server's own mamba flags: a
    server caps its running requests at the slots over that ratio)."""
    from poolfuzz.adapters.sglang.pools.configurator import server_flags, server_sized

    config = server_sized(config) if config.free_memory_kib else config  # capped: the config's rows (it admits)
    if not config.has_mamba:
        return config
    if tree_problem(api, config) is None:
        publish_defaults()  # what the tree reads
    flags = server_flags(config)
    return mamba_sized(config, server={k: flags[k] for k in ("disable_overlap_schedule", "mamba_radix_cache_strategy")
                                       if k in flags})


def _common():
    try:
        from sglang.srt.mem_cache import common
    except ImportError:
        return None
    needed = ("match_kv_cache", "checkpoint_kv_cache", "release_kv_cache", "evict_from_tree_cache")
    return common if all(hasattr(common, n) for n in needed) else None


# =============================================================================================
# Requests: SGLang's own Req, answering the adapter's flat names too
# =============================================================================================
def _kv_field(name: str) -> property:
    return property(lambda self: getattr(self.kv, name), lambda self, v: setattr(self.kv, name, v))


def tree_req_class(api) -> type:
    record_fields = set(vars(api.ReqKvInfo).get("__dataclass_fields__", {}))
    attrs = {name: _kv_field(name) for name in FLAT_FIELDS if name in record_fields}

    def seqlen_get(self):
        return self._poolfuzz_seqlen

    def seqlen_set(self, value):
        self._poolfuzz_seqlen = value

    attrs["seqlen"] = property(seqlen_get, seqlen_set)
    attrs["release_kv_record"] = lambda self: None
    attrs["__repr__"] = lambda self: f"SGLangTreeReq({self.rid})"
    return type("PoolfuzzTreeReq", (api.Req,), attrs)


def _released_len(req) -> int:
    """The allocated length release_kv_cache is shown. After a speculative step the harness keeps the
    page holding the last committed token (allocated past committed); a speculative server's release
    frees ``[ceil_page(committed), allocated)``, which is empty then, while a plain server asserts
    allocated == committed. The harness mixes both kinds of step on one server, so the adapter shows
    the committed length: the paged free of the committed positions frees that page whole, as SGLang's
    speculative release does."""
    return min(req.kv_allocated_len, req.kv_committed_len) if req.kv_committed_len else req.kv_allocated_len


def _released_committed(req) -> int:
    """The committed length release_kv_cache is shown: SGLang's extend allocation commits the tokens it
    allocates (``kv_committed_len = seq_len`` in ``alloc_for_extend``), so a request released between its
    first allocation and its forward (the family contract's program) has committed what it allocated."""
    return req.kv_committed_len or req.kv_allocated_len


# =============================================================================================
# The protocol
# =============================================================================================
class SGLangTreeProtocol(SGLangProtocol):
    """The chunk-cache protocol of :class:`SGLangProtocol`, with SGLang's tree where a scheduler has one."""

    def __init__(self, api):
        super().__init__()
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.common = _common()
        self.req_cls = tree_req_class(api)
        self.sampling = SamplingParams
        self.finish_length, self.finish_abort = FINISH_LENGTH, FINISH_ABORT
        self.tokens: dict[int, list[int]] = {}  # rid -> its token ids, prompt and output
        self.turns: dict[int, int] = {}  # rid of a next turn begun, not yet admitted -> its source's prefix

    # --- requests ----------------------------------------------------------------------------
    def _tokens(self, rid: int, n: int) -> list[int]:
        toks = self.tokens.setdefault(rid, [])
        while len(toks) < n:
            toks.append(token_of(rid, len(toks)))
        return toks

    def standin(self, req, family):
        got = self.standins.get(req.rid)
        if got is None:
            toks = self._tokens(req.rid, req.seqlen)
            got = self.req_cls(rid=str(req.rid), origin_input_text="", origin_input_ids=array("q", toks),
                               sampling_params=self.sampling(max_new_tokens=1 << 20))
            self.standins[req.rid] = got
        got.seqlen = req.seqlen
        return got

    def token_ids(self, rid: int) -> list[int] | None:
        return list(self.tokens[rid]) if rid in self.tokens else None

    def adopt_token_ids(self, rid: int, tokens: list[int]) -> None:
        """The request's own ids (a fork's prefix is its source's tokens), not ids made up on this node: its KV
        and its L3 pages are keyed by them here as on the node it came from."""
        self.tokens[rid] = list(tokens)
        sg = self.standins.get(rid)
        if sg is not None:  # the pre-allocation made the decode side's request: its prompt, as received
            sg.origin_input_ids = array("q", self._tokens(rid, len(sg.origin_input_ids))[:len(sg.origin_input_ids)])

    def _sync_ids(self, req, sg) -> None:
        """Output ids as far as the harness sampled: SGLang keys the tree by prompt + output ids."""
        toks = self._tokens(req.rid, req.seqlen)
        prompt = len(sg.origin_input_ids)
        sg.output_ids = array("q", toks[prompt:req.seqlen])
        sg.refresh_fill_ids()

    def _protected(self, req, sg) -> None:
        req.cache_protected_len = int(sg.kv.cache_protected_len)

    # --- admission -----------------------------------------------------------------------------
    def _fresh(self, rid: int, tokens: list[int] | None = None) -> None:
        """A new request under ``rid`` (an id a failed admit or fork left behind is reused)."""
        self.standins.pop(rid, None)
        self.tokens[rid] = list(tokens or [])

    def admit(self, req, family) -> None:
        self._fresh(req.rid)
        super().admit(req, family)
        self._match_and_lock(req, family, self.standin(req, family))

    def _match_and_lock(self, req, family, sg) -> int:
        """``match_kv_cache`` then ``tree_cache.lock(last_node)``: the prefix hit, in tokens."""
        self._sync_ids(req, sg)
        tree = family.tree
        # init_next_round_input: a mamba tree copies the matched state into a slot of the request's
        # own (allocated here, evicting if it must), deferred to the request's first extend forward
        l3.prefetch(tree, sg, self.common)  # on arrival: what storage holds past the host's hit, onto the host
        self.common.match_kv_cache(sg, tree, cow_mamba=tree.supports_mamba())
        hicache.load_back(tree, sg)  # a match ending on the host: the adder loads it back first
        sg.lock = tree.lock(sg.last_node)
        return int(sg.prefix_len)

    def run_deferred_mamba_ops(self, reqs, family) -> None:
        """The extend forward's deferred copy-on-write (``_maybe_execute_deferred_mamba_cow_and_clear``,
        fed by ``_collect_deferred_mamba_cow_and_clear``): the matched checkpoint's state into the
        request's slot; a fresh slot is cleared as before."""
        if family.has_recurrent_state():
            pool = family.sg_req_pool
            for req in reqs:
                kv = self.standin(req, family).kv
                if kv.mamba_cow_src_index is not None and kv.mamba_pool_idx is not None:
                    src = kv.mamba_cow_src_index.reshape(-1)
                    dst = kv.mamba_pool_idx.reshape(1)
                    pool.copy_mamba_state(pool.translate_mamba_indices(src), pool.translate_mamba_indices(dst))
                    kv.mamba_cow_src_index = None
                    kv.mamba_needs_clear = req.mamba_needs_clear = False
        super().run_deferred_mamba_ops(reqs, family)

    def _done(self, family) -> None:
        hicache.poll(family.tree)
        super()._done(family)

    # --- token allocation: evict first, as SGLang's allocation helpers do -------------------------
    def _evict_swa(self, req, family, pre_len: int) -> None:
        """With a tree an extend evicts no SWA itself; a decode evicts as the scheduler's trigger says."""
        sg = self.standin(req, family)
        if tree_swa.decoding(req, sg):
            tree_swa.evict_window(family, sg, pre_len)
        req.swa_evicted_seqlen = self._swa_evicted(sg, family)

    def _alloc_tokens(self, family, *, prefix_len: int, seq_len: int, last_loc: int, sg=None,
                      first: bool = False) -> torch.Tensor:
        n = seq_len - prefix_len
        ps = family.config.page_size
        decode = sg is not None and n == 1 and prefix_len > 0
        if n > 0 and not decode:  # a decode's check_decode_mem evicts for itself
            demand = n if ps == 1 else self._paged_demand(family, prefix_len, seq_len)
            self.common.evict_from_tree_cache(family.tree, demand)
        return super()._alloc_tokens(family, prefix_len=prefix_len, seq_len=seq_len, last_loc=last_loc, sg=sg,
                                     first=first)

    @staticmethod
    def _paged_demand(family, prefix_len: int, seq_len: int) -> int:
        alloc = family.sg_allocator
        conservative = seq_len - prefix_len + alloc.page_size
        demand = getattr(alloc, "get_extend_allocation_demand", None)
        if demand is None:
            return conservative
        return int(demand(torch.tensor([prefix_len]), torch.tensor([seq_len]), conservative_num_tokens=conservative,
                          shard_size=1))

    # --- after a prefill forward: the tree takes what was computed ------------------------------
    def after_prefill(self, req, family) -> None:
        try:
            sg = self.standin(req, family)
            self._sync_ids(req, sg)
            sg.kv.kv_committed_len = req.kv_committed_len
            sg.kv.kv_allocated_len = req.kv_allocated_len
            sg.extend_end = req.kv_committed_len
            self.common.checkpoint_kv_cache(sg, family.tree)
            self._protected(req, sg)
            if family.config.has_swa:  # the checkpoint frees what slid out of the window
                req.swa_evicted_seqlen = self._swa_evicted(sg, family)
        finally:
            self._done(family)

    # --- release --------------------------------------------------------------------------------
    def release_kv(self, req, family) -> None:
        """Finish: the tree keeps what it can key (``release_kv_cache(checkpoint=True)``), inside the
        batch's free group as ``process_batch_result_*`` calls it."""
        with free_group(family.sg_allocator):
            self._release_through_tree(req, family, checkpoint=True)

    def abort(self, req, family) -> None:
        if req.req_pool_idx is None:
            self.discard(req, family)
        else:
            with free_group(family.sg_allocator):
                self._release_through_tree(req, family, checkpoint=False)

    def _release_through_tree(self, req, family, *, checkpoint: bool) -> None:
        try:
            sg = self.standin(req, family)
            if not sg.kv.kv_allocated_len:
                # A row without KV (admitted, never prefilled): SGLang binds the row and the KV in one
                # alloc_for_extend, so release_kv_cache asserts it never sees this; give the row back.
                family.tree.unlock(sg.lock)
                sg.lock = None
                super()._release(req, family)
                req.cache_protected_len = 0
                return
            self._sync_ids(req, sg)
            sg.kv.kv_committed_len = _released_committed(req)
            sg.kv.kv_allocated_len = _released_len(req)
            if checkpoint:
                sg.finished_reason = self.finish_length(length=len(sg.output_ids))
            elif sg.finished_reason is None:
                sg.finished_reason = self.finish_abort()
            self.common.release_kv_cache(sg, family.tree, checkpoint=checkpoint)
            sg.finished_reason = None
            req.req_pool_idx = req.mamba_pool_idx = None
            req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = 0
            sg.kv.cache_protected_len = sg.kv.cache_inserted_len = 0
        finally:
            self._done(family)

    def _release(self, req, family) -> None:
        """Retraction's release (``release_req``): no checkpoint, then evict what became evictable."""
        sg = self.standin(req, family)
        sg.kv.kv_committed_len = _released_committed(req)
        sg.kv.kv_allocated_len = _released_len(req)
        self.common.release_kv_cache(sg, family.tree, checkpoint=False)
        sg.kv.cache_protected_len = sg.kv.cache_inserted_len = 0
        req.req_pool_idx = req.mamba_pool_idx = None
        req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = 0

    def reset_for_retract(self, req) -> None:
        super().reset_for_retract(req)
        req.cache_protected_len = 0

    def _pre_alloc(self, req, family, fill_len: int) -> None:
        """The decode pre-allocation evicts from the tree first (``_pre_alloc``: ``evict_for_alloc`` for
        the full pages, the SWA tail's reclaim); the paged SWA tail allocation does not evict itself."""
        cfg = family.config
        if cfg.has_swa and cfg.page_size > 1 and family.resume_swa_tail_only:
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            ps, alloc = cfg.page_size, family.sg_allocator
            tail = fill_len - window_start(cfg, fill_len)
            full_short = -(-fill_len // ps) * ps - alloc.full_available_size()
            swa_short = -(-tail // ps) * ps - alloc.swa_available_size()
            if full_short > 0 or swa_short > 0:
                family.tree.evict_for_alloc(EvictParams(num_tokens=max(full_short, 0),
                                                        swa_num_tokens=max(swa_short, 0)))
        super()._pre_alloc(req, family, fill_len)

    def pre_alloc(self, req, family, fill_len: int) -> None:
        super().pre_alloc(req, family, fill_len)
        sg = self.standin(req, family)
        sg.lock = family.tree.lock(family.tree.root_node_handle())  # a resume holds no prefix: the root
        sg.last_node = family.tree.root_node_handle()

    # --- fork: a new request whose prompt starts with the source's committed tokens ---------------
    def peek_hit(self, family, src_rid: int, prefix: int, seqlen: int) -> tuple[int, int, int]:
        """What the radix match of a fork of ``src_rid`` finds (a throwaway request), and the tree's
        evictable tokens once that hit is locked, as the fork locks it before it allocates (locked
        and unlocked again: nothing stays held)."""
        toks = self._tokens(src_rid, prefix)[:prefix] + [token_of(0, p) for p in range(prefix, seqlen)]
        hit, _, evictable, swa_evictable = self._probe(family, toks)
        return min(hit, prefix), evictable, swa_evictable

    def fork(self, src, dst, family) -> None:
        """A new request whose prompt is the source's committed tokens and more, as the scheduler admits
        one: its row budget, then ``init_next_round_input`` (the match; on a mamba tree the state's
        copy-on-write slot), the adder's lock, then ``alloc_req_slots`` and the KV of what was not hit.
        A fork that does not fit leaves nothing behind: its id goes to the next request, on either node
        (a transfer's pre-allocation would otherwise pick up the failed fork's prompt)."""
        try:
            self._fork(src, dst, family)
        except PoolError:
            self.standins.pop(dst.rid, None)
            self.tokens.pop(dst.rid, None)
            raise

    def _fork(self, src, dst, family) -> None:
        prefix = src.kv_committed_len
        self._fresh(dst.rid, self._tokens(src.rid, src.seqlen)[:prefix])
        sg = self.standin(dst, family)
        if family.sg_req_pool.available_size() <= 0:  # get_num_allocatable_reqs: no match is tried
            raise PoolExhausted(space="rows", requested=1, available=family.sg_req_pool.available_size())
        self._admit_and_compute(dst, family, sg, prefix)

    # --- a chat's next turn: a new request whose prompt continues a finished one's tokens ---------
    def begin_turn(self, req, family, *, src_rid: int, prefix: int) -> dict:
        """The next turn of finished ``src_rid`` arrives: its first ``prefix`` tokens, then its own. The
        scheduler's policy matches it first (a throwaway probe here, as for a fork): the device hit, and
        on a HiCache tree the host hit after it, which admission loads back."""
        self._fresh(req.rid, self._tokens(src_rid, prefix)[:prefix])
        self.turns[req.rid] = prefix
        hit, host, evictable, swa_evictable = self._probe(family, self.tokens[req.rid] + [token_of(req.rid, p)
                                                                          for p in range(prefix, req.seqlen)])
        return {"hit": hit, "host": host, "evictable": evictable, "swa_evictable": swa_evictable}

    def end_turn(self, req, family) -> None:
        """The turn did not fit: nothing of it stays (the scheduler leaves it waiting)."""
        self.turns.pop(req.rid, None)
        self.standins.pop(req.rid, None)
        self.tokens.pop(req.rid, None)

    def resume(self, req, family) -> None:
        """A retracted request's resume, or a next turn's admission (``begin_turn``): the prefill adder's
        match, load-back and lock, ``alloc_req_slots``, then one extend of every prompt token but the
        last (what the hit did not cover is computed again)."""
        if req.rid not in self.turns:
            return super().resume(req, family)
        self.turns.pop(req.rid)
        sg = self.standin(req, family)
        if family.sg_req_pool.available_size() <= 0:  # get_num_allocatable_reqs: no match is tried
            raise PoolExhausted(space="rows", requested=1, available=family.sg_req_pool.available_size())
        self._admit_and_compute(req, family, sg, req.seqlen - 1)

    def _admit_and_compute(self, req, family, sg, upto: int) -> None:
        """A fork's or next turn's admission of ``[0, upto)``: the match and lock, the row and the hit's slots,
        then one extend of what the hit did not cover (computed again); nothing stays if it does not fit."""
        try:
            hit = min(self._match_and_lock(req, family, sg), upto)
            self._admit_hit(req, family, sg, hit)
        finally:
            self._done(family)
        try:
            self.extend(req, family, upto)
        except PoolExhausted:
            self._release_through_tree(req, family, checkpoint=False)
            raise
        req.kv_committed_len = sg.kv.kv_committed_len = upto
        req.recompute_from = hit if hit < upto else None
        if family.has_recurrent_state() and hit < upto:
            req.state_recompute_from = hit  # that forward starts from the copied (or cleared) state

    def _probe(self, family, toks: list[int]) -> tuple[int, int, int, int]:
        """What the radix match of ``toks`` finds (a throwaway request): the device hit, the host hit
        after it, and the tree's evictable tokens, then evictable SWA tokens, with the device hit locked (locked
        and unlocked again): the lock protects the hit's window of SWA too."""
        probe = self.req_cls(rid="poolfuzz-peek", origin_input_text="", origin_input_ids=array("q", toks),
                             sampling_params=self.sampling(max_new_tokens=1 << 20))
        probe.refresh_fill_ids()
        self.common.match_kv_cache(probe, family.tree, cow_mamba=False)
        lock = family.tree.lock(probe.last_node)
        evictable = int(family.tree.evictable_size())
        swa_evictable = int(family.tree.swa_evictable_size()) if family.config.has_swa else 0
        family.tree.unlock(lock)
        return int(probe.prefix_len), int(probe.host_hit_length), evictable, swa_evictable

    def _admit_hit(self, dst, family, sg, hit: int) -> None:
        """After the match: the row (reverted as the scheduler reverts a request the adder did not
        add), then the hit's slots at the head of it, held by the tree."""
        try:
            SGLangProtocol.admit(self, dst, family)
        except PoolError:
            self._not_added(sg, family)
            raise
        if sg.kv.mamba_cow_src_index is not None:  # the copy replaces the clear of a fresh slot
            sg.kv.mamba_needs_clear = dst.mamba_needs_clear = False
        if hit:
            indices = family.tree.prefix_device_indices(sg)[:hit]
            self._write_row(dst, family, 0, indices.to(torch.int64))
        dst.kv_allocated_len = sg.kv.kv_allocated_len = hit
        dst.kv_committed_len = sg.kv.kv_committed_len = hit
        dst.cache_protected_len = sg.kv.cache_protected_len = hit

    def _not_added(self, sg, family) -> None:
        """The scheduler's revert for a matched request the adder did not add: drop the staged
        copy-on-write, give back the state slot the match took, unlock."""
        kv = sg.kv
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        if kv.mamba_pool_idx is not None and kv.req_pool_idx is None:
            family.sg_req_pool.mamba_allocator.free(kv.mamba_pool_idx.unsqueeze(-1))
            kv.mamba_pool_idx = None
        family.tree.unlock(sg.lock)
        sg.lock = None


# =============================================================================================
# The family and its reference
# =============================================================================================
class SGLangTreeFamily(SGLangFamily):
    """SGLang's pools with SGLang's own prefix tree in front of them.

    Capabilities the harness reads:
      ``supports_fork``: True; a fork is a radix hit on the source's cached prefix (shared slots,
      locked), its unmatched tokens computed again.
      ``cached_units()``: the slots the tree holds (counted as held, never free, never twice); a live
      request's protected prefix (``ReqKv.cache_protected_len``) is the tree's, not the request's.
      ``reference_factory``: :class:`TreeReference`, bound to this family's tree.
      ``caches_freed_units``: True; a finished request's KV is checkpointed into the tree, not freed:
      the free listener hears of it when the tree evicts it.
    """

    supports_fork = True
    supports_next_turn = False  # set per config by ``with_tree``: a next turn goes through the tree's match
    hierarchical = False  # HiCache: the tree has a host tier (``hicache.py``)
    storage_dir: str | None = None  # HiCache's L3 tier: the ``file`` backend's directory (``l3.py``), or None
    storage_reader: object = None  # reads the L3 pages back for the checks (``l3.StorageReader``)
    caches_freed_units = True  # a finished request's KV goes into the tree, freed (and reported) when evicted
    tree: object = None

    def cached_units(self) -> dict[str, list[int]]:
        ps = self.config.page_size
        # RadixCache's flatten cats nothing on an empty tree (a ValueError): it holds no slot then
        values = self.tree.all_values_flatten() if self.tree_sizes()[0] else torch.empty(0, dtype=torch.int64)
        # the slots the tree's values are: full KV, or an all-SWA model's window slots (PureSWARadixCache)
        out = {"full" if self.config.has_full else "swa": sorted({int(v) // ps for v in values.tolist()})}
        if self.tree.supports_mamba():  # the recurrent-state checkpoints the tree holds
            out["mamba"] = sorted(int(v) for v in self.tree.all_mamba_values_flatten().tolist())
        return out

    def close(self) -> None:
        """The end of the example (the engine's ``close``): a tree with a host tier detaches its storage
        backend, whose four threads stop, and its files go; the ``atexit`` hook SGLang registered goes too."""
        if self.hierarchical:
            l3.close(self.tree, self.storage_dir)
            self.storage_dir = None

    def take_stored_pages(self) -> list:
        """HiCache's L3 pages stored since the last call, read back for the checks (``l3.StorageReader``)."""
        return self.storage_reader.take() if self.storage_reader is not None else []

    def flush_prefix_cache(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        # every token the tree could hold (an all-SWA model's tree holds window slots: PureSWARadixCache)
        tokens = max(self.config.full_tokens, self.config.swa_tokens)
        self.tree.evict(EvictParams(num_tokens=tokens, mamba_num=self.config.mamba_slots))
        self.notify_frees()

    def idle_problem(self) -> str | None:
        """What SGLang's own idle memory check reports on this idle node, or None (``idle_check``)."""
        return idle_check.problem(self)

    def flush_cache(self) -> None:
        """``Scheduler.flush_cache``: the tree is reset first (its nodes dropped, not freed one by one; a
        HiCache tree clears its host pool too), then the pools in place."""
        self.tree.reset()
        super().flush_cache()

    def tree_swa(self) -> tuple[int, int]:
        """(SWA slots the tree holds, of them evictable), by the tree's own accounting."""
        evictable = int(self.tree.swa_evictable_size())
        return evictable + int(self.tree.swa_protected_size()), evictable

    def tree_mamba(self) -> tuple[int, int]:
        """(state slots the tree holds, of them evictable), by the tree's own accounting."""
        evictable = int(self.tree.mamba_evictable_size())
        return evictable + int(self.tree.mamba_protected_size()), evictable

    def tree_sizes(self) -> tuple[int, int]:
        """(tokens the tree holds, tokens of them evictable), by the tree's own accounting."""
        return int(self.tree.evictable_size() + self.tree.protected_size()), int(self.tree.evictable_size())

    @property
    def reference_factory(self):
        family = self

        def build(config, *, backup_mode, **capabilities):
            from poolfuzz.adapters.sglang.tree.tree_reference import TreeReference

            return TreeReference(config, backup_mode=backup_mode, family=family, **capabilities)

        return build


_HICACHE_REFUSED: dict = {}  # config -> why SGLang's HiCache assembler refused its pool


def with_tree(family: SGLangFamily) -> SGLangFamily:
    """The family with SGLang's tree in front of its pools, where the tree path drives the config;
    else the family unchanged (a chunk cache: no prefix sharing, ``supports_fork`` False)."""
    if tree_problem(family.api, family.config) is not None:
        return family
    out = SGLangTreeFamily(**{f.name: getattr(family, f.name) for f in fields(family)})
    # and the capabilities set per family when built (pd_decode, supports_transfer, resume_swa_tail_only)
    names = {f.name for f in fields(family)}
    out.__dict__.update({k: v for k, v in vars(family).items() if k not in names})
    # A next turn goes through the tree's match, as a fork does. Not on SWA configs: a turn's window
    # on the PD decode node is not modelled by the tree reference (swa-ssm: a transfer after a decode-node
    # turn of 18 tokens finds SWA short where the reference predicts success, 14 steps).
    out.supports_next_turn = not family.config.has_swa
    out.hierarchical = hicache.hicache_problem(family.api, family.config, pd_decode=family.pd_decode) is None
    refused = _HICACHE_REFUSED.get(family.config) if out.hierarchical else None
    if refused is None:
        if out.hierarchical and l3.storage_problem(family.api, family.config) is None:
            out.storage_dir = l3.new_directory()
        try:
            out.tree = build_tree(out, hierarchical=out.hierarchical, storage_dir=out.storage_dir)
        except ValueError as exc:
            if not out.hierarchical:
                raise
            # SGLang's HiCache assembler refuses the pool (0.5.23: a MiniMax pool with index values): the
            # server runs the tree without a host tier. Asked once per config (SGLang logs the refusal).
            refused = _HICACHE_REFUSED[family.config] = (f"SGLang's HiCache refuses this pool "
                                                         f"({str(exc).splitlines()[0]})")
    if refused is not None:
        l3.close(None, out.storage_dir)
        out.storage_dir = None
        out.declined = dict(out.declined, hicache=refused)
        out.hierarchical = False
        out.tree = build_tree(out, hierarchical=False)
    if out.hierarchical:  # a backstop for an engine nobody closes (a test's): its threads stop with the family
        weakref.finalize(out, l3.close, out.tree, out.storage_dir)
    out.protocol = SGLangTreeProtocol(family.api)
    if l3.enabled(out.tree):
        out.storage_reader = l3.StorageReader(tree=out.tree, config=out.config, tokens=out.protocol.tokens,
                                              owner_of=lambda token: token >> TOKEN_SHIFT)
    out.admission.tree_cache = out.tree
    out.snapshot_free_lists()
    return out
