"""Catalogue of switchable faults, each a small override that reproduces a bug SGLang shipped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from poolfuzz.pools.allocator import TokenAllocator, as_index
from poolfuzz.pools.blueprint import Blueprint
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, PoolExhausted
from poolfuzz.pools.flush_faults import ClearKeepsStateSlots
from poolfuzz.pools.free_faults import AbortMidPrefillLeaksLastChunk, FreeGroupDropsSWAPile
from poolfuzz.pools.grid_faults import MambaLayerMapAssumesContiguous, ReloadChunkAtChunkNumber
from poolfuzz.pools.host import HostKVPool
from poolfuzz.pools.host_faults import HostLoadStopsAtPoolLayerCount, HostPageStrideOmitsALayer
from poolfuzz.pools.kv import SWAKVPool
from poolfuzz.pools.mamba import MambaSlotAllocator
from poolfuzz.pools.prefix_tree import MambaPrefixTree
from poolfuzz.pools.quant_faults import FP4CopyWithoutScales, FP4MHACopyWithoutScales, QuantStoreSkipsLastToken
from poolfuzz.pools.protocol import ServingProtocol
from poolfuzz.pools.req_to_token import HybridReqToTokenPool
from poolfuzz.pools.window_faults import ReleaseFreesEvictedWindow
from poolfuzz.pools.spec_faults import CommitsByBatchPosition, CommitsLastDraft
from poolfuzz.pools.storage_faults import (DSACopyWithoutIndexCache, DSAIndexScalesTransposed,
                                           HybridMLATransferItemOfHeadWidth, MiniMaxCopySkipsKOnlyIndex,
                                           MLACopiesValueBufferOnly, MLATransferItemOfLatentWidth,
                                           ScaledCopyWithoutScales, ScaledMoveWithoutScales,
                                           TransferWithoutBlockScales, TransferWithoutDSAState)
from poolfuzz.pools.swa_allocator import SWATokenAllocator
from poolfuzz.pools.transfer import PDTransfer


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One historical bug class, switched on by id through ``build_family(..., faults=[id])``."""

    id: str
    description: str
    upstream: str  # the SGLang PR or commit it mirrors
    applies_to: Callable[[ModelConfig], bool]
    overrides: dict  # Blueprint field -> replacement
    backup_mode: str | None = None  # the retraction path the bug lives on; selected when none is asked for

    def __repr__(self) -> str:
        return f"Fault({self.id})"


# Each fault is the smallest override of the correct class that reproduces one bug SGLang
# shipped and fixed; the docstring says what the correct code does instead.

# --- retraction backup --------------------------------------------------------------------------
class CallerSkipsMambaBackup(ServingProtocol):
    """Pre-#35957 ``offload_kv_cache``: trusts the KV pool with ``mamba_indices``. SWAKVPool
    accepts and ignores them, so nobody backs the recurrent state up."""

    def mamba_pool_needing_backup(self, req, family):
        return None


def resolve_backup_by_attention_only(config, kv_pool_cls, predicate) -> str:
    """Pre-#35957 ``resolve_decode_retraction_backup``: looks at the attention layout only, so an
    SWA+SSM model gets host_pool, whose backups carry full KV and SWA but no recurrent state."""
    return "host_pool" if kv_pool_cls.supports_host_pool_backup else "cpu_tensor"


class CallerAlwaysBacksUpMamba(ServingProtocol):
    """Ignores ``cpu_copy_carries_mamba``: HybridLinearKVPool already copies the state, and the
    caller copies it again (the second branch of the #35957 unit test)."""

    def mamba_pool_needing_backup(self, req, family):
        return None if req.mamba_pool_idx is None else family.req_pool.mamba_pool


class BackupDropsLastToken(ServingProtocol):
    """Backs up ``seqlen - 2`` tokens: the last written token's KV is lost (seqlen-1 contract)."""

    def backup_tokens(self, req):
        return req.seqlen - 2


class BackupIncludesUnwrittenToken(ServingProtocol):
    """Backs up ``seqlen`` tokens: includes the last sampled token, which has no KV slot yet."""

    def backup_tokens(self, req):
        return req.seqlen


class SWAReloadIgnoresMasks(SWAKVPool):
    """Reload writes the backed-up SWA rows into the first mapped positions of the new row,
    instead of the positions mapped both then and now: rows land on the wrong positions."""

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        idx = as_index(indices)
        self.full_kv_pool.load_cpu_copy(cpu.full, idx)
        if cpu.swa is None:
            return
        new_swa = self.translate(idx)
        mapped = new_swa[new_swa > 0][: cpu.swa.num_tokens]
        self.swa_kv_pool.load_cpu_copy(_first_rows(cpu.swa, mapped.numel()), mapped)


class ReloadIntoOldIndices(ServingProtocol):
    """Reload recomputes the token indices from the slots the request held *before* retraction
    (already freed and reused) instead of the newly allocated row."""

    def __init__(self):
        super().__init__()
        self._old_tokens: dict[int, torch.Tensor] = {}  # rid -> token slots held at retraction
        self._old_mamba: dict[int, int | None] = {}

    def offload_kv_cache(self, req, family):
        self._old_tokens[req.rid] = family.req_pool.read(req.req_pool_idx, 0, self.backup_tokens(req))
        self._old_mamba[req.rid] = req.mamba_pool_idx
        return super().offload_kv_cache(req, family)

    def load_kv_cache(self, req, family, backup):
        tokens = self._old_tokens.pop(req.rid)
        old = self._old_mamba.pop(req.rid)
        slot = None if old is None else torch.tensor([old])
        if backup.mamba_cpu is not None and slot is not None:
            family.req_pool.mamba_pool.load_cpu_copy(backup.mamba_cpu, slot)
        family.kv_pool.load_cpu_copy(backup.cpu_tensors, tokens, mamba_indices=slot)


class KeepsEvictedSeqlenOnRetract(ServingProtocol):
    """``reset_for_retract`` forgets ``swa_evicted_seqlen`` (#18059): the resumed request believes
    positions are evicted that its new row maps, and later evictions start from a stale frontier."""

    def reset_for_retract(self, req):
        kept = req.swa_evicted_seqlen
        super().reset_for_retract(req)
        req.swa_evicted_seqlen = kept


# --- mamba slots ----------------------------------------------------------------------------------
class MambaMappingNeverWritten(HybridReqToTokenPool):
    """``alloc_mamba`` hands the request a slot but never writes the row's entry of the row-to-mamba-slot
    mapping (``req_index_to_mamba_index_mapping``) that the attention backends index the state by, so the
    forward reads and writes whatever the row mapped before (slot 0, the padding slot, on a fresh row). The
    correct pool writes the mapping in the same call that takes the slot."""

    def alloc_mamba(self, row: int) -> int:
        return self.mamba_allocator.alloc_one()


class MambaSlotZeroAllocator(MambaSlotAllocator):
    """Hands out slot 0, the dummy target of padded (CUDA-graph) batches (#17404)."""

    def clear(self):
        super().clear()
        self._free.appendleft(0)
        self._is_free[0] = 1


class SkipsFreshSlotClear(ServingProtocol):
    """A freshly allocated mamba slot is never cleared before its first extend (#10400 class):
    the request starts from whatever the previous owner left."""

    def run_deferred_mamba_ops(self, reqs, family):
        for req in reqs:
            req.mamba_needs_clear = False
        super().run_deferred_mamba_ops(reqs, family)


class ForkWithoutCopy(ServingProtocol):
    """The deferred copy-on-write is dropped: the forked request starts from an uncopied slot."""

    def run_deferred_mamba_ops(self, reqs, family):
        for req in reqs:
            if req.mamba_cow_src is not None:
                self.unlock_cow_source(req, family)
        super().run_deferred_mamba_ops(reqs, family)


class StaleCowSource(ServingProtocol):
    """The copy-on-write source is the matched request's *live* slot, not a checkpoint taken at
    match time (#29354 class): if the source decodes first, the fork starts from a newer state."""

    def __init__(self):
        super().__init__()
        self._live_sources: dict[int, int] = {}  # rid -> the other request's live slot its COW reads

    def fork(self, src, dst, family):
        super().fork(src, dst, family)
        if dst.mamba_cow_src is not None:
            self._live_sources[dst.rid] = src.mamba_pool_idx

    def run_deferred_mamba_ops(self, reqs, family):
        pool = family.req_pool.mamba_pool
        for req in reqs:
            live = self._live_sources.pop(req.rid, None)
            if live is not None and req.mamba_cow_src is not None:
                pool.copy_from([live], [req.mamba_pool_idx])
                self.unlock_cow_source(req, family)
                req.mamba_needs_clear = False
        super().run_deferred_mamba_ops(reqs, family)

    def release_kv(self, req, family):
        self._live_sources.pop(req.rid, None)
        super().release_kv(req, family)


class CowKeepsSourceLocked(ServingProtocol):
    """The copy-on-write never gives its source back: the tree node a fork matched stays locked after
    the copy (its lock receipt is never replayed), so the tree can never evict that checkpoint and
    its mamba slot is lost to every later request. The correct copy unlocks the node
    (``dec_lock_ref``) once the state is in the request's own slot."""

    def unlock_cow_source(self, req, family):
        req.mamba_cow_src = None


# --- prefix tree ---------------------------------------------------------------------------------
class EvictionIgnoresLock(MambaPrefixTree):
    """Eviction takes least recently used checkpoints whether or not a request has locked them, so a
    pending copy-on-write reads a slot the tree gave away. The correct tree skips every node whose
    ``lock_ref`` is above zero."""

    def may_evict(self, node):
        return True


class EvictionKeepsNode(MambaPrefixTree):
    """Eviction frees a checkpoint's slot but leaves its node in the tree, so a later match hands
    out a node whose slot was freed (and may hold another request's state by then). The correct
    tree removes the node with its slot."""

    def drop(self, node):
        self.allocator.free([node.slot])


class ResumeLeaksMambaOnAbort(ServingProtocol):
    """A resume whose KV does not fit aborts its load-back but keeps the mamba slot it already
    took (#12693 / #30986 class): a leak that grows with every failed resume."""

    def pre_alloc(self, req, family, fill_len):
        try:
            super().pre_alloc(req, family, fill_len)
        except PoolExhausted as exc:
            if exc.space not in ("rows", "mamba"):  # the slot was taken before KV ran out
                family.req_pool.mamba_allocator.alloc_one()  # ... and is never given back
            raise


class TrackSlotsNotFreed(ServingProtocol):
    """Extra-buffer mode: releasing a request frees its state slot but not its ping-pong track
    slots (the #12693 leak class, on the slots the mode adds): every finished, retracted or aborted
    request leaks them until admission fails."""

    def free_track_slots(self, req, family):
        req.mamba_track = ()
        req.track_writes = 0


class PingPongStuck(ServingProtocol):
    """Extra-buffer mode with the overlap schedule: every forward writes the first track slot, so
    the slot the previous step wrote (which the overlapped scheduler may still be caching from) is
    overwritten, and the second slot never holds the state it should."""

    def next_track_slot(self, req, family):
        if not req.mamba_track:
            return None
        req.track_writes += 1
        return req.mamba_track[0]


# --- sliding window -------------------------------------------------------------------------------
class EvictsOneTokenTooMany(ServingProtocol):
    """Window eviction uses ``pre_len - window + 1``: frees a token still inside the window (#22470 class)."""

    def evict_swa(self, req, family, pre_len):
        super().evict_swa(req, family, pre_len + 1)


class FreeSWAKeepsMapping(SWATokenAllocator):
    """``free_swa`` frees the SWA slots but leaves ``full_to_swa`` pointing at them (#25805), so
    releasing the row later frees the same SWA slots again."""

    def free_swa(self, indices):
        idx = self._widen_to_pages(as_index(indices))
        swa = self.full_to_swa[idx]
        live = swa[swa > 0]
        if live.numel():
            self.swa.free(live)


class SilentTokenAllocator(TokenAllocator):
    """SGLang's production free list: no double-free detection, a second free appends again."""

    def free(self, indices):
        idx = as_index(indices)
        if idx.numel():
            self._release(sorted(set((idx // self.page_size).tolist())))


class SilentDoubleFreeSWAAllocator(FreeSWAKeepsMapping):
    """#25805 as production saw it: the mapping is not zeroed and the SWA free list does not
    notice the double free, so one SWA slot is later handed to two requests."""

    def __init__(self, *, size, size_swa, page_size):
        super().__init__(size=size, size_swa=size_swa, page_size=page_size)
        self.swa = SilentTokenAllocator(size=size_swa, page_size=page_size, space="swa")


class FreesPartialPages(ServingProtocol):
    """Frees the rejected draft tokens' slots as they are, not whole pages past the committed
    one: the paged allocator frees the whole page, still in use (#4977, #9989, #27779 class)."""

    def free_speculative_tail(self, req, family):
        if req.kv_committed_len < req.kv_allocated_len:
            family.allocator.free(family.req_pool.read(req.req_pool_idx, req.kv_committed_len,
                                                       req.kv_allocated_len))
            req.kv_allocated_len = req.kv_committed_len


class HostLoadTilesOfFour(HostKVPool):
    """Loads each host page back in one tile of four token rows (a kernel tuned on page sizes 1 to
    4): every row of pages up to 4 tokens comes back; from page size 8 on, the rows past the fourth
    of each page keep whatever the reused device slot held (page-size-dependent kernel faults,
    sglang#23596 class)."""

    def load_to_device(self, device_pool, host_idx, dev_idx):
        h, d = as_index(host_idx), as_index(dev_idx)
        keep = torch.arange(h.numel()) % self.page_size < 4  # a restore starts on a page boundary
        super().load_to_device(device_pool, h[keep], d[keep])


class DiscardKeepsSWAHostSlots(ServingProtocol):
    """Aborting a retracted request frees its host_pool backup's full-KV host slots but not the SWA
    host pool's (SGLang's ``discard_kv_cache_backup`` frees the anchor pool's indices, then the side
    pools' through ``HostPoolGroup.release_transfers``; a discard without the second leaks the SWA host
    pool until every backup of an SWA model finds it full and aborts)."""

    def discard(self, req, family):
        backup = req.retraction_backup
        req.retraction_backup = None
        for t in backup.host_transfers if backup is not None else ():
            if t.space == "host.full":
                family.host_pools[t.space].free(t.host_indices)


# --- PD transfer ------------------------------------------------------------------------------------
class TransferWithoutMambaFallback(PDTransfer):
    """Appends only the state types the KV pool knows: an SWA+SSM model's recurrent state, which
    lives in the request pool, never crosses to the decode node."""

    def state_components(self, family):
        return [(t, "kv_pool") for t in family.kv_pool.state_types]


def _first_rows(copy, n):
    from poolfuzz.pools.kv import select_rows

    keep = torch.zeros(copy.num_tokens, dtype=torch.bool)
    keep[:n] = True
    return select_rows(copy, keep)


def _swa_and_mamba(c: ModelConfig) -> bool:
    return c.has_swa and c.has_mamba


def _mixed_swa(c: ModelConfig) -> bool:
    """SWA beside full attention: the SWA allocator with its full_to_swa mapping, and SWA host pools."""
    return c.has_swa and c.has_full


def _all_swa(c: ModelConfig) -> bool:
    return c.has_swa and not c.has_full


def _mamba_carried_by_kv_pool(c: ModelConfig) -> bool:
    return c.has_mamba and not c.has_swa


def _paged(c: ModelConfig) -> bool:
    return c.page_size > 1


def _mla_unquantised(c: ModelConfig) -> bool:  # MLATokenToKVPool itself (FP4 MLA is its own class)
    return c.attention == "mla" and not c.kv_quant


def _any(c: ModelConfig) -> bool:
    return True


def _host_mha_layers(c) -> bool:  # an MHA host pool of two or more layers (no scale buffers, which it cannot hold)
    return len(c.full_layer_ids) > 1 and not c.has_mamba and _host_mha(c)


def _host_mha(c) -> bool:
    return c.attention == "mha" and not c.kv_scale_block and c.kv_quant != "fp4_mx_block16"


def _f(id, upstream, applies_to, overrides, description=None, backup_mode=None):
    cls = next(iter(overrides.values()))
    text = description or (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    text = " ".join(text.split())
    return Fault(id=id, description=text, upstream=upstream, applies_to=applies_to, overrides=overrides,
                 backup_mode=backup_mode)


FAULTS: dict[str, Fault] = {
    f.id: f
    for f in [
        _f("swa-ignores-mamba-backup", "sglang#35957", _swa_and_mamba, {"protocol": CallerSkipsMambaBackup},
           "SWA pool accepts mamba_indices and ignores them; the caller does not back the recurrent state up"),
        _f("host-pool-for-ssm", "sglang#35957", _swa_and_mamba,
           {"backup_resolver": resolve_backup_by_attention_only},
           "the backup-mode predicate looks only at the attention layout, so an SWA+SSM model takes "
           "host_pool, which drops recurrent state"),
        _f("mamba-backed-up-twice", "sglang#35957", _mamba_carried_by_kv_pool,
           {"protocol": CallerAlwaysBacksUpMamba}),
        _f("mamba-slot-zero", "sglang#17404", lambda c: c.has_mamba, {"mamba_allocator": MambaSlotZeroAllocator}),
        _f("mamba-mapping-not-written", "HybridReqToTokenPool.alloc's row-to-mamba mapping (get_mamba_indices)",
           lambda c: c.has_mamba, {"hybrid_req_pool": MambaMappingNeverWritten}),
        _f("mamba-not-cleared", "sglang#10400", lambda c: c.has_mamba, {"protocol": SkipsFreshSlotClear}),
        _f("flush-keeps-state-slots", "sglang#28185 (HybridReqToTokenPool.clear releases the checkpoint pool)",
           lambda c: c.has_mamba, {"hybrid_req_pool": ClearKeepsStateSlots}),
        _f("backup-drops-last-token", "sglang#23346 (seqlen-1)", _any, {"protocol": BackupDropsLastToken}),
        _f("backup-includes-unwritten-token", "sglang#23346 (seqlen-1)", _any,
           {"protocol": BackupIncludesUnwrittenToken}),
        _f("swa-reload-unmapped-rows", "sglang#35888", _mixed_swa, {"swa_kv_pool": SWAReloadIgnoresMasks},
           backup_mode="cpu_tensor"),
        _f("swa-evict-off-by-one", "sglang#22470", lambda c: c.has_swa, {"protocol": EvictsOneTokenTooMany}),
        # Paged configs resume with tail-only SWA, which sets the frontier explicitly and masks it.
        _f("swa-evicted-seqlen-not-reset", "sglang#18059", lambda c: c.has_swa and c.page_size == 1,
           {"protocol": KeepsEvictedSeqlenOnRetract}),
        _f("free-swa-keeps-mapping", "sglang#25805", _mixed_swa, {"swa_allocator": FreeSWAKeepsMapping}),
        _f("paged-free-partial-page", "sglang#27779", _paged, {"protocol": FreesPartialPages}),
        _f("pd-drops-mamba-fallback", "sglang#35957 (PD)", _swa_and_mamba,
           {"transfer": TransferWithoutMambaFallback}),
        _f("cow-without-copy", "sglang#29354", lambda c: c.has_mamba, {"protocol": ForkWithoutCopy}),
        _f("stale-cow-source", "sglang#29354", lambda c: c.has_mamba, {"protocol": StaleCowSource}),
        _f("cow-source-stays-locked", "mamba radix cache lock_ref (a lock receipt never replayed)",
           lambda c: c.has_mamba, {"protocol": CowKeepsSourceLocked}),
        _f("tree-evicts-locked-node", "mamba radix cache lock_ref", lambda c: c.has_mamba,
           {"prefix_tree": EvictionIgnoresLock}),
        _f("tree-match-freed-node", "mamba radix cache eviction", lambda c: c.has_mamba,
           {"prefix_tree": EvictionKeepsNode}),
        _f("reload-into-old-indices", "sglang#23346", _any, {"protocol": ReloadIntoOldIndices},
           backup_mode="cpu_tensor"),
        _f("mamba-leak-on-abort", "sglang#12693", lambda c: c.has_mamba, {"protocol": ResumeLeaksMambaOnAbort}),
        _f("allocator-double-free-undetected", "sglang#25805", _mixed_swa,
           {"swa_allocator": SilentDoubleFreeSWAAllocator}),
        _f("host-discard-keeps-swa-slots", "host_pool retraction discard (HostPoolGroup.release_transfers)",
           lambda c: _mixed_swa(c) and not c.has_mamba and c.attention == "mha" and not c.kv_scale_block,
           {"protocol": DiscardKeepsSWAHostSlots}, backup_mode="host_pool"),
        _f("host-load-stops-at-pool-layer-count", "HiCache layer-wise load (transfer_layer_id_max: model layers)",
           lambda c: _mixed_swa(c) and not c.has_mamba and c.attention == "mha" and not c.kv_scale_block,
           {"host_pool": HostLoadStopsAtPoolLayerCount}, backup_mode="host_pool"),
        _f("host-page-stride-omits-a-layer", "HiCache page_first layout (kernel backend: layout_dim)",
           _host_mha_layers, {"host_pool": HostPageStrideOmitsALayer}, backup_mode="host_pool"),
        # Off the named grid: each applies to named configs too, where it cannot show (contexts of
        # at most 64 tokens, blocked layers, page sizes 1 and 4); drawn configs reach it.
        _f("reload-chunk-at-chunk-number", "sglang#7409 (chunked offload)", _any,
           {"mha_kv_pool": ReloadChunkAtChunkNumber}, backup_mode="cpu_tensor"),
        _f("mamba-layer-map-contiguous", "sglang#20457 (layer-id map)", lambda c: c.has_mamba,
           {"mamba_pool": MambaLayerMapAssumesContiguous}),
        _f("host-load-tiles-of-four", "sglang#23596 (page-size kernel)",
           lambda c: c.page_size > 1 and not c.has_mamba and _host_mha(c),
           {"host_pool": HostLoadTilesOfFour}, backup_mode="host_pool"),
        # Modes: the extra slots a request holds in mamba extra-buffer mode
        _f("track-slots-not-freed", "sglang#12693 class (mamba ping-pong track buffers)",
           lambda c: c.mamba_track_slots > 0, {"protocol": TrackSlotsNotFreed}),
        _f("ping-pong-stuck", "mamba extra buffer with the overlap schedule (ping-pong index)",
           lambda c: c.mamba_track_slots == 2, {"protocol": PingPongStuck}),
        # Speculative decoding's scratch rows: the commit after verify picks the wrong state
        _f("spec-commit-last-draft", "MTP verify commit (last_correct_step_indices vs accept length)",
           lambda c: c.spec_draft_tokens > 0, {"spec_scratch": CommitsLastDraft}),
        _f("spec-commit-batch-position", "MTP verify commit scratch rows (src_indices_raw, stable rows)",
           lambda c: c.spec_draft_tokens > 0, {"spec_scratch": CommitsByBatchPosition}),
        # Pool classes that store KV other than as K and V rows: each fault drops or misplaces one buffer.
        _f("mla-copy-drops-rope", "MLA get_value_buffer is the latent part only", _mla_unquantised,
           {"mla_kv_pool": MLACopiesValueBufferOnly}),
        _f("mla-pd-item-of-latent-width", "MLA PD item lengths (get_contiguous_buf_infos)",
           _mla_unquantised, {"mla_kv_pool": MLATransferItemOfLatentWidth}),
        _f("hybrid-mla-pd-item-of-head-width", "HybridLinearKVPool use_mla (Kimi-Linear PD buffer registration)",
           lambda c: c.has_mamba and c.attention == "mla", {"hybrid_kv_pool": HybridMLATransferItemOfHeadWidth}),
        _f("dsa-copy-drops-index", "DSA get_cpu_copy offloads index_k with the KV", lambda c: c.attention == "dsa",
           {"dsa_kv_pool": DSACopyWithoutIndexCache}),
        _f("dsa-index-scales-transposed", "DSA IndexKeyCache page layout (per-token scales)",
           lambda c: c.attention == "dsa" and c.page_size > 1, {"dsa_kv_pool": DSAIndexScalesTransposed}),
        _f("pd-drops-dsa-index", "DSA PD state component (StateType.DSA)", lambda c: c.attention == "dsa",
           {"transfer": TransferWithoutDSAState}),
        _f("scaled-copy-drops-scales", "MXFP8 get_cpu_copy carries the block scales", lambda c: c.kv_scale_block > 0,
           {"scaled_kv_pool": ScaledCopyWithoutScales}),
        _f("pd-drops-block-scales", "MXFP8 PD state component (StateType.BLOCK_SCALE)",
           lambda c: c.kv_scale_block > 0, {"transfer": TransferWithoutBlockScales}),
        _f("scaled-move-drops-scales", "MXFP8 move_kv_cache override (accepted-token move after tree verify)",
           lambda c: c.kv_scale_block > 0, {"scaled_kv_pool": ScaledMoveWithoutScales}),
        _f("quant-store-skips-last-token", "CPUFP8KVCacheMethod.quantize_and_store (quantised set_kv_buffer)",
           lambda c: c.kv_quant == "cpu_fp8_e4m3", {"quant_kv_pool": QuantStoreSkipsLastToken}),
        _f("fp4-copy-drops-scales", "MLATokenToKVPoolFP4 get_cpu_copy / load_cpu_copy (inherited from MLA)",
           lambda c: c.kv_quant == "fp4_mx_block16" and c.latent, {"mla_fp4_kv_pool": FP4CopyWithoutScales}),
        _f("fp4-mha-copy-drops-scales", "MHATokenToKVPool get_cpu_copy / load_cpu_copy (k/v only), FP4 quant method",
           lambda c: c.kv_quant == "fp4_mx_block16" and not c.latent, {"mha_fp4_kv_pool": FP4MHACopyWithoutScales}),
        _f("msa-copy-skips-k-only-index", "MiniMaxSparseKVPool sub-pools (index_k_pool: sparse_disable_index_value)",
           lambda c: bool(c.msa_layer_ids("K")), {"msa_kv_pool": MiniMaxCopySkipsKOnlyIndex}),
        # Free patterns: grouped frees, and a row cut off between two prefill chunks.
        _f("free-group-drops-swa", "SWATokenToKVPoolAllocator.free_group_end (SWA piles)", _mixed_swa,
           {"swa_allocator": FreeGroupDropsSWAPile}),
        _f("abort-prefill-leaks-last-chunk", "chunked-prefill abort (release_kv_cache of the chunked req)", _any,
           {"protocol": AbortMidPrefillLeaksLastChunk}),
        # All-SWA models: the token slots are the window's own
        _f("release-frees-evicted-window", "all-SWA release_kv_cache (swa_dead_lo; PureSWATokenToKVPoolAllocator)",
           _all_swa, {"protocol": ReleaseFreesEvictedWindow}),
    ]
}


def get_fault(fault_id: str) -> Fault:
    try:
        return FAULTS[fault_id]
    except KeyError:
        raise ConfigError(f"unknown fault {fault_id!r}; known faults: {', '.join(FAULTS)}") from None


def required_backup_mode(fault_ids: Iterable[str]) -> str | None:
    """The backup path the chosen faults live on, or None; two different paths are a ConfigError."""
    modes = {get_fault(f).backup_mode for f in fault_ids} - {None}
    if len(modes) > 1:
        raise ConfigError(f"the chosen faults live on different backup paths ({', '.join(sorted(modes))}); "
                          "switch them on one at a time")
    return modes.pop() if modes else None


def blueprint_with(fault_ids: Iterable[str], config: ModelConfig) -> Blueprint:
    """The default blueprint with each named fault's overrides applied; validates the ids.

    Faults compose: two faults that replace the same class with overrides of different methods
    are switched on together (a class deriving from both, each override calling ``super()``).
    Two that override the same method, or replace the same function, conflict: a ConfigError.
    """
    bp = Blueprint()
    default = Blueprint()
    owners: dict[str, list[str]] = {}  # role -> the faults that replaced it so far
    for fid in fault_ids:
        fault = get_fault(fid)
        if not fault.applies_to(config):
            raise ConfigError(f"fault {fid!r} does not apply to config {config.name!r}; "
                              f"configs it applies to: {', '.join(applicable_configs(fid))}")
        changes = {}
        for role, replacement in fault.overrides.items():
            current = getattr(bp, role)
            if role in owners:
                base = getattr(default, role)
                clash = _clash(base, current, replacement)
                if clash:
                    raise ConfigError(f"faults {', '.join(map(repr, owners[role]))} and {fid!r} both change "
                                      f"{clash}; switch them on one at a time")
                replacement = type(f"{current.__name__}+{replacement.__name__}", (replacement, current),
                                   {"__doc__": f"{current.__doc__}\n\n{replacement.__doc__}"})
            owners.setdefault(role, []).append(fid)
            changes[role] = replacement
        bp = dataclasses.replace(bp, **changes)
    return bp


# Names a fault class may define without changing behaviour another fault could also change.
_HARMLESS = frozenset({"__init__", "__doc__", "__module__", "__qualname__", "__dict__", "__weakref__"})


def _overridden(cls: type, base: type) -> set[str]:
    """What ``cls`` changes of ``base``: every name defined between them in the MRO."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is base or (isinstance(base, type) and issubclass(base, klass)):
            continue
        names.update(vars(klass))
    return names - _HARMLESS


def _clash(base, current, replacement) -> str | None:
    """What two replacements of one role both change (None: they compose), as words."""
    if not (isinstance(base, type) and isinstance(current, type) and isinstance(replacement, type)):
        name = getattr(base, "__name__", "it")
        return f"the function {name}"
    shared = sorted(_overridden(current, base) & _overridden(replacement, base))
    if shared:
        return f"{base.__name__}.{shared[0]}"
    return None


def applicable_configs(fault_id: str) -> list[str]:
    from poolfuzz.pools.config import CONFIGS

    fault = get_fault(fault_id)
    return [name for name, c in CONFIGS.items() if fault.applies_to(c)]
