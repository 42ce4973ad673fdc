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

from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable
from poolfuzz.adapters.sglang.pools.family import served_words
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


def build_swa(api: SGLangAPI, c: ModelConfig, dev, served) -> UnifiedFamily:
    """The family over a hybrid SWA model's unified pools as SGLang's configurator built them for its server
    (``served``): ``init_unified_swa_pools``' pair, or with Mamba layers too ``init_unified_mamba_swa_pools``' tri-pool
    (state | SWA | full)."""
    bundle = served_bundle(served)
    return _swa_family(api, c, dev, bundle, bundle.req_to_token_pool, served)


def _swa_family(api: SGLangAPI, c: ModelConfig, dev, bundle, req_pool, served) -> UnifiedFamily:
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
        kv_pool=KVPoolView(kv_pool, comps, door=door), allocator=UnifiedSWAView(alloc), served=served,
        pools_source=served_words(served))
    family.unified_buffer = bundle.unified_memory_pool
    family._free_views = views
    return family
