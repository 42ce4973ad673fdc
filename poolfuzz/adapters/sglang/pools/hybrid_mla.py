"""Kimi-Linear's pools: SGLang's ``HybridLinearKVPool`` with an MLA full-attention sub-pool (``use_mla=True``), or a DSA
one (``use_dsa=True``: the latent rows and the indexer's page-major index cache).

Built by SGLang's configurator (``_build_hybrid_linear_kv_pool``) for an MLA model with recurrent layers. The pool
routes a model layer id to its MLA sub-pool's layer (``_transfer_id_context`` for the write door,
``_transfer_full_attention_id`` for the read door), so the components are read through the hybrid pool's own door
and written through its ``set_kv_buffer`` (DSA's index keys through its ``get_index_k_with_scale_buffer``, written
directly, as for a plain DSA pool). A sub-pool that keeps none of the latent rows (or the DSA index cache) the config's
components live in declines the config (``storage.buffers_problem``): SGLang built another server's pools.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import SGLangAPI
from poolfuzz.adapters.sglang.pools.reads import read_door, stored_bytes
from poolfuzz.adapters.sglang.pools.storage import buffers_problem, single_rank, storage_of
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.latent import latent_components

def hybrid_mla_components(api: SGLangAPI, pool, c: ModelConfig) -> list[Component]:
    """The latent (and index) components of the ``HybridLinearKVPool`` SGLang's configurator built for the config's
    server, each as the MLA (and DSA) kernels get it from the pool by model layer id."""
    single_rank(api)
    if problem := buffers_problem(getattr(pool, "full_kv_pool", pool), c):
        raise ConfigError(f"config {c.name!r}: {problem}")
    r = c.kv_lora_rank
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        # What an MLA backend reads from the hybrid pool by model layer id: ``get_kv_buffer``, the whole latent
        # row as K and its compressed part as V (views of the sub-pool's buffer, checked in place)
        row = read_door(pool, "get_key_buffer", layer_id, pool.full_kv_pool.kv_buffer[local])
        # an fp8 pool hands them out in its dtype: checked as the bytes it stores, as the sub-pool's host copy is
        key, value = (stored_bytes(t) for t in pool.get_kv_buffer(layer_id))
        if key.data_ptr() != row.data_ptr() or value.data_ptr() != row.data_ptr() or value.shape[-1] != r:
            raise ConfigError(f"config {c.name!r}: HybridLinearKVPool.get_kv_buffer({layer_id}) does not hand out "
                              "the MLA sub-pool's latent row (K) and its compressed part (V) in place")
        out += latent_components(key[:, 0], r, layer=layer_id)
    if storage_of(c).index_cache:
        out += _index_components(pool, c)
    return out


def _index_components(pool, c: ModelConfig) -> list[Component]:
    """DSA's index keys of each layer, page-major, as the indexer gets them from the hybrid pool by model layer
    (``get_index_k_with_scale_buffer``); the scales are four bytes a token, too few for a tag (as for DSA)."""
    ps = c.page_size
    if pool.full_kv_pool.page_size // getattr(pool.full_kv_pool, "index_kpool", 1) != ps:
        raise ConfigError(f"config {c.name!r}: SGLang's DSA index pages are not {ps}-token pages; poolfuzz reads them "
                          "by the KV page")
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        buf = pool.get_index_k_with_scale_buffer(layer_id)
        if buf.data_ptr() != pool.full_kv_pool.index_k_with_scale_buffer[local].data_ptr():
            raise ConfigError(f"config {c.name!r}: HybridLinearKVPool.get_index_k_with_scale_buffer({layer_id}) does "
                              "not hand out the DSA sub-pool's index cache of that layer in place")
        keys = buf[:, :ps * c.index_head_dim].view(-1, ps, c.index_head_dim)
        out.append(Component(name="dsa.index_k", layer=layer_id, space="full", tensor=keys, page_size=ps))
    return out
