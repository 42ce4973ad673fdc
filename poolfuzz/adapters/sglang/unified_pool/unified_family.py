"""The family on SGLang's unified memory pool, as its servers' kernels address it: components read through SGLang's
virtual -> physical tables, and the pieces every unified stack shares (``unified.py``, ``unified_swa.py``)."""

from __future__ import annotations

import types
from typing import Callable

import torch

from poolfuzz.adapters.sglang.pools.family import SGLangFamily
from poolfuzz.adapters.sglang.pools.views import MambaPoolView
from poolfuzz.pools.components import Component
from poolfuzz.pools.latent import latent_components


class UnifiedFamily(SGLangFamily):
    """SGLang's pools built on the unified memory pool, which the unified servers run on
    (``scheduler/unified_server.py``).

    SGLang hands out *virtual* slot ids (what ``req_to_token`` and the mamba mapping hold); the data lives at the
    *physical* rows of one shared byte buffer, found through each sub-allocator's ``virtual_to_physical`` table,
    which compaction rebinds when it moves rows. Every component is SGLang's own physical view, its slot ids
    translated through that table (``Component.translate``), so a move that drops a row, a mapping never written
    (the page-0 sink) or two ids on one page reads as another request's data, and the checksums name whose.
    ``unified_buffer``: the byte buffer the sub-pools share.
    """

    unified_buffer: object = None

    def __repr__(self) -> str:
        return f"UnifiedFamily({self.config.name}, sglang {self.api.version}, {self.device})"


def token_translate(allocator) -> Callable[[torch.Tensor], torch.Tensor]:
    """SGLang's own virtual -> physical token id translation of a ``MultiEndedAllocator``."""
    return lambda ids: allocator.translate_kv_loc(ids).to(torch.int64)


def translated_kv(pool, layer_ids, space: str, translate, *, latent_rank: int | None = None) -> list[Component]:
    """K and V of each layer of a unified MHA sub-pool, SGLang's physical views read through ``translate``. With
    ``latent_rank``, the sub-pool is MLA's: one latent row a layer, whose first ``latent_rank`` values are the
    compressed KV (``mla.latent``) and the rest the rope part (``mla.rope``; none on a NoPE model)."""
    if latent_rank is not None:
        return [comp for local, layer_id in enumerate(layer_ids)
                for comp in latent_components(pool.kv_buffer[local][:, 0], latent_rank, layer=layer_id,
                                              translate=translate)]
    return [Component(name=f"{space}.{part}", layer=layer_id, space=space, tensor=buffers[local], translate=translate)
            for local, layer_id in enumerate(layer_ids)
            for part, buffers in (("k", pool.k_buffer), ("v", pool.v_buffer))]


def state_view(req_pool, layer_ids) -> MambaPoolView:
    """The unified Mamba pool's state, each layer through the kernels' door (``mamba2_layer_cache``); a state kernel
    is handed slot ids translated already (``translate_mamba_indices``), so the components translate nothing."""
    return MambaPoolView(req_pool.mamba_pool, layer_ids, req_pool=req_pool)


def prewarm_compaction(allocator) -> None:
    """What the scheduler does right after it builds a unified pool (0.5.23: ``prewarm_compaction``, the
    first compaction move made before serving). A release whose allocator has no such step (0.5.22) builds
    without it, as its scheduler does."""
    prewarm = getattr(allocator, "prewarm_compaction", None)
    if prewarm is not None:
        prewarm()


def served_bundle(served):
    """The pools SGLang's configurator built for a unified server, in the shape of a unified factory's result."""
    return types.SimpleNamespace(req_to_token_pool=served.req_to_token_pool, token_to_kv_pool=served.token_to_kv_pool,
                                 token_to_kv_pool_allocator=served.allocator, unified_memory_pool=served.unified_buffer)
