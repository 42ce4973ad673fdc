"""The unified memory pool of a hybrid sliding-window model (``init_unified_swa_pools``) as a family.

SGLang builds one byte buffer shared by the full-attention KV sub-pool (growing down) and the sliding-window
KV sub-pool (growing up), under ``UnifiedSWATokenToKVPoolAllocator``: one virtual id space, owned by the full
side; the SWA side binds the same virtual pages to its own physical pages and unbinds them when the window
moves past them (``free_swa``). A full slot's SWA slot is therefore the same virtual id while the SWA side
holds it, and none (0) after: that is the translation the model-runner stand-in reads (``UnifiedSWAView.translate``),
before the SWA side's own table maps the id to its physical row.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable, call_with
from poolfuzz.adapters.sglang.pools.family import KV_DTYPES
from poolfuzz.adapters.sglang.pools.request_pool import build_plain_request_pool, mamba_cache_params, pool_kwargs
from poolfuzz.adapters.sglang.unified_pool.unified_family import (
    UnifiedFamily, prewarm_compaction, served_bundle, state_view, token_translate, translated_kv,
)
from poolfuzz.adapters.sglang.pools.views import FreeListView, KVPoolView, ReqPoolView, as_ints
from poolfuzz.adapters.sglang.pools.writes import as_pool_dtype, RadixAttentionFields
from poolfuzz.pools.config import ModelConfig, uses_ssm_state


def swa_factory():
    """SGLang's ``init_unified_swa_pools``, or None where the release has no unified pool."""
    return first_importable("sglang.srt.mem_cache.unified_memory_pool:init_unified_swa_pools", required=False)


class UnifiedSWAView:
    """The composite allocator; ``translate`` maps a full (virtual) slot to its SWA slot: itself while the
    SWA side binds its page, 0 once the window left it (SGLang's ``translate_loc_from_full_to_swa`` gives the
    physical row; the runner's SWA components translate the virtual id themselves)."""

    def __init__(self, allocator):
        self.allocator = allocator

    def translate(self, indices) -> torch.Tensor:
        swa = self.allocator.swa_attn_allocator
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        bound = swa.virtual_to_physical[idx // swa.pool_page_size] >= 0
        return torch.where(bound & (idx > 0), idx, torch.zeros_like(idx))


def tri_factory():
    """SGLang's ``init_unified_mamba_swa_pools`` (the tri-pool), or None."""
    return first_importable("sglang.srt.mem_cache.unified_memory_pool:init_unified_mamba_swa_pools", required=False)


def build_swa(api: SGLangAPI, c: ModelConfig, dev, sdev: str, *, need_sort: bool, served=None,
              decode_rows: int | None = None) -> UnifiedFamily:
    """The family over the pools the configurator built for the config's server (``served``), or over
    ``_init_unified_swa_pools`` for the config's model on one rank, lazy compaction on (SGLang's default); with Mamba
    layers too, ``_init_unified_mamba_swa_pools`` (the tri-pool: state | SWA | full)."""
    if served is not None:
        bundle = served_bundle(served)
        return _swa_family(api, c, dev, bundle, bundle.req_to_token_pool)
    kv_dtype = KV_DTYPES[c.kv_dtype]
    args = dict(
        device=sdev, kv_cache_dtype=kv_dtype, head_num=c.head_num, head_dim=c.head_dim, v_head_dim=c.head_dim,
        swa_head_num=c.head_num, swa_head_dim=c.head_dim, swa_v_head_dim=c.head_dim, page_size=c.page_size,
        start_layer=0, end_layer=c.num_layers, swa_attention_layer_ids=list(c.swa_layer_ids),
        full_attention_layer_ids=list(c.full_layer_ids), full_max_total_num_tokens=c.full_tokens,
        swa_max_total_num_tokens=c.swa_tokens, enable_memory_saver=False, need_sort=need_sort,
        lazy_compaction=True, sliding_window_size=c.sliding_window)
    if c.has_mamba:
        modes = pool_kwargs(c)
        args.update(mamba_layer_ids=list(c.mamba_layer_ids), mamba2_cache_params=mamba_cache_params(api, c),
                    max_mamba_cache_size=c.mamba_slots, extra_max_context_len=4, max_num_reqs=c.request_rows,
                    enable_mamba_extra_buffer=modes["enable_mamba_extra_buffer"],
                    enable_mamba_extra_buffer_lazy=False,
                    disable_overlap_schedule=not modes["enable_overlap_schedule"])
        # rows as wide as the full side can ever grow (see unified._build_mamba)
        sized = call_with(tri_factory(), model_context_len=c.max_context, **args)
        ever = sized.token_to_kv_pool_allocator.full_attn_allocator.max_slots
        bundle = call_with(tri_factory(), model_context_len=max(c.max_context, ever), **args)
        req_pool = bundle.req_to_token_pool
    else:
        bundle = call_with(swa_factory(), model_context_len=c.max_context, **args)
    if not c.has_mamba:  # the configurator's plain request pool (a decode server's): rows as wide as the full side
        full = bundle.token_to_kv_pool_allocator.full_attn_allocator  # can grow, a decode server's extra rows beside
        req_pool = build_plain_request_pool(api, c, sdev, decode_rows=decode_rows,
                                            width=max(c.max_context, full.max_slots))
    return _swa_family(api, c, dev, bundle, req_pool)


def _swa_family(api: SGLangAPI, c: ModelConfig, dev, bundle, req_pool) -> UnifiedFamily:
    alloc, kv_pool = bundle.token_to_kv_pool_allocator, bundle.token_to_kv_pool
    full, swa = alloc.full_attn_allocator, alloc.swa_attn_allocator
    prewarm_compaction(alloc)

    comps = translated_kv(kv_pool.full_kv_pool, c.full_layer_ids, "full", token_translate(full))
    comps += translated_kv(kv_pool.swa_kv_pool, c.swa_layer_ids, "swa", token_translate(swa))
    mamba_view = state_view(req_pool, c.mamba_layer_ids) if c.has_mamba else None
    write_loc = first_importable("sglang.srt.mem_cache.memory_pool:KVWriteLoc")

    def door(*, slots, rows):
        """The backend's write: the full side's physical rows, and the SWA side's for the same ids."""
        loc = slots.to(torch.int64)
        physical = write_loc(alloc.translate_write_loc(loc), swa_loc=alloc.translate_loc_from_full_to_swa(loc),
                             physical=True)
        done = set()
        for space, layer_id in [("full", i) for i in c.full_layer_ids] + [("swa", i) for i in c.swa_layer_ids]:
            k, v = (f"{space}.k", layer_id), (f"{space}.v", layer_id)
            if k in rows and v in rows:
                kv_pool.set_kv_buffer(RadixAttentionFields(layer_id), physical, as_pool_dtype(rows[k], kv_pool),
                                      as_pool_dtype(rows[v], kv_pool))
                done |= {k, v}
        return done

    ps = c.page_size
    universe = range(full.min_page_index, full.num_virtual_ids)

    def swa_free() -> list[int]:
        bound = set((swa.virtual_to_physical[:-1] >= 0).nonzero().reshape(-1).tolist())
        return [p for p in universe if p not in bound]

    views = {"rows": FreeListView(space="rows", owner=req_pool, read=lambda: as_ints(req_pool.free_slots),
                                  available=req_pool.available_size),
             "full": FreeListView(space="full", owner=full, read=lambda: as_ints(full.free_virtual_ids),
                                  available=lambda: full.free_virtual_ids.numel() * ps, page_size=ps,
                                  sources=lambda: [full.free_virtual_ids]),
             "swa": FreeListView(space="swa", owner=swa, read=swa_free, available=lambda: len(swa_free()) * ps,
                                 page_size=ps, sources=lambda: [swa.virtual_to_physical])}
    if c.has_mamba:
        mamba = alloc.mamba_allocator
        views["mamba"] = FreeListView(space="mamba", owner=mamba, read=lambda: as_ints(mamba.free_virtual_ids),
                                      available=lambda: mamba.free_virtual_ids.numel(),
                                      sources=lambda: [mamba.free_virtual_ids])
    family = UnifiedFamily(
        api=api, config=c, device=dev, uses_ssm_state=uses_ssm_state(c), sg_req_pool=req_pool, sg_kv_pool=kv_pool,
        sg_allocator=alloc, req_pool=ReqPoolView(req_pool, mamba=mamba_view, rows=views["rows"],
                                                 mamba_free=views.get("mamba")),
        kv_pool=KVPoolView(kv_pool, comps, door=door), allocator=UnifiedSWAView(alloc))
    family.unified_buffer = bundle.unified_memory_pool
    family._free_views = views
    return family
