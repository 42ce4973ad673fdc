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

from array import array
from dataclasses import fields

import torch

from poolfuzz.adapters.sglang.family import SGLangFamily
from poolfuzz.adapters.sglang.frees import free_group
from poolfuzz.adapters.sglang.protocol import SGLangProtocol
from poolfuzz.adapters.sglang.standin import _FLAT_FIELDS
from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.reference import ReferenceFamily, RefRequest, _pages

TOKEN_SHIFT = 20  # position bits of a traceable token id


def token_of(rid: int, position: int) -> int:
    return rid << TOKEN_SHIFT | position


def tree_problem(api, config) -> str | None:
    """Why forks do not go through SGLang's tree for ``config`` here, or None."""
    if _common() is None:
        return (f"SGLang {api.version} has no mem_cache.common.match_kv_cache / checkpoint_kv_cache / "
                "release_kv_cache (the scheduler glue the adapter calls)")
    if config.has_swa or config.has_mamba:
        return ("the tree's SWA and mamba components are not driven yet (their window tombstones and "
                "recurrent-state checkpoints need the scheduler's SWA lock release and mamba COW bookkeeping)")
    return None


def _common():
    try:
        from sglang.srt.mem_cache import common
    except ImportError:
        return None
    needed = ("match_kv_cache", "checkpoint_kv_cache", "release_kv_cache", "evict_from_tree_cache")
    return common if all(hasattr(common, n) for n in needed) else None


_PUBLISHED: dict[str, bool] = {}


def _publish_defaults() -> None:
    """The tree reads the server's configuration from SGLang's runtime context: where nothing is
    published yet, install default server arguments once per process (no model, so no resolution
    pipeline, which would fetch one: every field keeps its default)."""
    if _PUBLISHED:
        return
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    context = runtime_context.get_context()
    if not context.is_config_namespace_published("memory"):
        context.set_server_args(ServerArgs(model_path="poolfuzz-no-model", device="cpu"))
        # The server's widths now come from the arguments; the rank a launcher would write is the
        # single rank of a CPU run (MLA's pools and their retraction read it).
        parallel = runtime_context.get_parallel()
        try:
            parallel.attn_dcp_rank
        except (RuntimeError, ValueError):
            parallel.override_permanently(attn_dcp_rank=0)
    _PUBLISHED["done"] = True


def build_tree(family: SGLangFamily):
    """The tree the release's scheduler builds for this model (its registry's default chain)."""
    _publish_defaults()
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    c = family.config
    params = CacheInitParams(disable=False, req_to_token_pool=family.sg_req_pool,
                             token_to_kv_pool_allocator=family.sg_allocator, page_size=c.page_size)
    ctx = registry.TreeCacheBuildContext(
        server_args=None, params=params, is_hybrid_swa=c.has_swa, is_hybrid_ssm=c.has_mamba,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
        tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=c.full_tokens)
    return registry.default_radix_cache_factory(ctx)


# =============================================================================================
# Requests: SGLang's own Req, answering the adapter's flat names too
# =============================================================================================
def _kv_field(name: str) -> property:
    return property(lambda self: getattr(self.kv, name), lambda self, v: setattr(self.kv, name, v))


def tree_req_class(api) -> type:
    record_fields = set(vars(api.ReqKvInfo).get("__dataclass_fields__", {}))
    attrs = {name: _kv_field(name) for name in _FLAT_FIELDS if name in record_fields}

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
        self.common.match_kv_cache(sg, tree, cow_mamba=False)
        sg.lock = tree.lock(sg.last_node)
        return int(sg.prefix_len)

    # --- token allocation: evict first, as SGLang's allocation helpers do -------------------------
    def _alloc_tokens(self, family, *, prefix_len: int, seq_len: int, last_loc: int, sg=None) -> torch.Tensor:
        n = seq_len - prefix_len
        ps = family.config.page_size
        decode = sg is not None and n == 1 and prefix_len > 0
        if n > 0 and not decode:  # a decode's check_decode_mem evicts for itself
            demand = n if ps == 1 else self._paged_demand(family, prefix_len, seq_len)
            self.common.evict_from_tree_cache(family.tree, demand)
        return super()._alloc_tokens(family, prefix_len=prefix_len, seq_len=seq_len, last_loc=last_loc, sg=sg)

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

    def pre_alloc(self, req, family, fill_len: int) -> None:
        super().pre_alloc(req, family, fill_len)
        sg = self.standin(req, family)
        sg.lock = family.tree.lock(family.tree.root_node_handle())  # a resume holds no prefix: the root
        sg.last_node = family.tree.root_node_handle()

    # --- fork: a new request whose prompt starts with the source's committed tokens ---------------
    def peek_hit(self, family, src_rid: int, prefix: int, seqlen: int) -> tuple[int, int]:
        """What the radix match of a fork of ``src_rid`` finds (a throwaway request), and the tree's
        evictable tokens once that hit is locked, as the fork locks it before it allocates (locked
        and unlocked again: nothing stays held)."""
        toks = self._tokens(src_rid, prefix)[:prefix] + [token_of(0, p) for p in range(prefix, seqlen)]
        probe = self.req_cls(rid="poolfuzz-peek", origin_input_text="", origin_input_ids=array("q", toks),
                             sampling_params=self.sampling(max_new_tokens=1 << 20))
        probe.refresh_fill_ids()
        self.common.match_kv_cache(probe, family.tree, cow_mamba=False)
        lock = family.tree.lock(probe.last_node)
        evictable = int(family.tree.evictable_size())
        family.tree.unlock(lock)
        return min(int(probe.prefix_len), prefix), evictable

    def fork(self, src, dst, family) -> None:
        prefix = src.kv_committed_len
        self._fresh(dst.rid, self._tokens(src.rid, src.seqlen)[:prefix])
        try:
            super().admit(dst, family)
            sg = self.standin(dst, family)
            hit = min(self._match_and_lock(dst, family, sg), prefix)
            if hit:
                indices = family.tree.prefix_device_indices(sg)[:hit]
                self._write_row(dst, family, 0, indices.to(torch.int64))
            dst.kv_allocated_len = sg.kv.kv_allocated_len = hit
            dst.kv_committed_len = sg.kv.kv_committed_len = hit
            dst.cache_protected_len = sg.kv.cache_protected_len = hit
        finally:
            self._done(family)
        try:
            self.extend(dst, family, prefix)  # the unmatched tokens are computed again
        except PoolExhausted:
            self._release_through_tree(dst, family, checkpoint=False)
            raise
        dst.kv_committed_len = sg.kv.kv_committed_len = prefix
        dst.recompute_from = hit if hit < prefix else None


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
    caches_freed_units = True  # a finished request's KV goes into the tree, freed (and reported) when evicted
    tree: object = None

    def cached_units(self) -> dict[str, list[int]]:
        values = self.tree.all_values_flatten()
        ps = self.config.page_size
        return {"full": sorted({int(v) // ps for v in values.tolist()})}

    def flush_prefix_cache(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=self.config.full_tokens))
        self.notify_frees()

    def tree_sizes(self) -> tuple[int, int]:
        """(tokens the tree holds, tokens of them evictable), by the tree's own accounting."""
        return int(self.tree.evictable_size() + self.tree.protected_size()), int(self.tree.evictable_size())

    @property
    def reference_factory(self):
        family = self

        def build(config, *, backup_mode, **capabilities):
            return TreeReference(config, backup_mode=backup_mode, family=family, **capabilities)

        return build


class TreeReference(ReferenceFamily):
    """The reference model with a prefix tree in front of the full pool.

    Rows are counted as the base model counts them. Full KV is counted as SGLang's tree would leave it:
    each live request holds privately the pages past its protected prefix; the tree holds what its own
    accounting says (``evictable_size + protected_size``); the rest must be free. An allocation
    succeeds if it fits in the free pages plus what the tree may evict. The tree's sizes and each
    request's protected length are read from the real tree: this audits that the allocator, the
    requests' rows and the tree's accounting add up, not which nodes the tree chose to keep.
    """

    def __init__(self, config, *, backup_mode: str, family: SGLangTreeFamily, **capabilities):
        super().__init__(config, backup_mode=backup_mode, **capabilities)
        self.family = family

    def _private_pages(self) -> int:
        protocol = self.family.protocol
        total = 0
        for rid, req in self.requests.items():
            if not req.holds_row:
                continue
            sg = protocol.standins.get(rid)
            protected = int(sg.kv.cache_protected_len) if sg is not None and sg.kv is not None else 0
            total += _pages(req.allocated, self.ps) - protected // self.ps
        return total

    def available(self, space: str) -> int:
        if space != "full":
            return super().available(space)
        held, _ = self.family.tree_sizes()
        return (self.total("full") - self._private_pages()) * self.ps - held

    def _need(self, needs: dict[str, int]) -> None:
        for space, n in needs.items():
            if space == "full":
                _, evictable = self.family.tree_sizes()
                have = self.available("full") + evictable
                if n * self.ps > have:
                    raise PoolExhausted(space=space, requested=n * self.ps, available=self.available(space))
            elif n > self.free.get(space, 0):
                raise PoolExhausted(space=space, requested=n * self._scale(space), available=self.available(space))

    def fork(self, src_rid: int, rid: int, *, seqlen: int | None = None) -> RefRequest:
        """A row, and full pages for the source's committed tokens the tree does not match (the
        match is the tree's: asked first, as the scheduler's policy asks before the adder locks)."""
        src = self.requests[src_rid]
        prefix = src.committed
        seqlen = prefix if seqlen is None else seqlen
        hit, evictable = self.family.protocol.peek_hit(self.family, src_rid, prefix, seqlen)
        self._need({"rows": 1})
        # the hit is locked before the allocation: what the tree may evict for it excludes the hit itself
        need = (_pages(prefix, self.ps) - hit // self.ps) * self.ps
        if need > self.available("full") + evictable:
            raise PoolExhausted(space="full", requested=need, available=self.available("full"))
        self.free["rows"] -= 1
        req = RefRequest(rid=rid, holds_row=True, allocated=prefix, committed=prefix, seqlen=seqlen,
                         kv_owner=list(src.kv_owner[:prefix]))
        self._fresh_track(req)
        self.requests[rid] = req
        return req


def with_tree(family: SGLangFamily) -> SGLangFamily:
    """The family with SGLang's tree in front of its pools, where the tree path drives the config;
    else the family unchanged (a chunk cache: no prefix sharing, ``supports_fork`` False)."""
    if tree_problem(family.api, family.config) is not None:
        return family
    out = SGLangTreeFamily(**{f.name: getattr(family, f.name) for f in fields(family)})
    # and the capabilities set per family when built (pd_decode, supports_transfer, resume_swa_tail_only)
    names = {f.name for f in fields(family)}
    out.__dict__.update({k: v for k, v in vars(family).items() if k not in names})
    out.tree = build_tree(out)
    out.protocol = SGLangTreeProtocol(family.api)
    out.admission.tree_cache = out.tree
    out.snapshot_free_lists()
    return out
