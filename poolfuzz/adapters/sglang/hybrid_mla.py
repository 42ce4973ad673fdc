"""Kimi-Linear's pools: SGLang's ``HybridLinearKVPool`` with an MLA full-attention sub-pool (``use_mla=True``).

Built as ``kv_cache_configurator._build_hybrid_linear_kv_pool`` builds it for an MLA model with recurrent
layers: the model's full-attention layer ids, the request pool's MambaPool, ``kv_lora_rank`` and
``qk_rope_head_dim``. The pool routes a model layer id to its MLA sub-pool's layer (``_transfer_id_context``
for the write door, ``_transfer_full_attention_id`` for the read door), so the components are read through the
hybrid pool's own door and written through its ``set_kv_buffer``; a release whose pool cannot be built with
``use_mla`` declines the config with the reason.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, construct
from poolfuzz.adapters.sglang.reads import read_door
from poolfuzz.adapters.sglang.storage import single_rank
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

_PROBE: dict[tuple, str | None] = {}


def hybrid_mla_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """Why this release cannot build the config's hybrid MLA pool, or None: a one-slot pool over a throwaway
    MambaPool-free build must route the model's full layer to an MLA sub-pool of latent rows."""
    key = (config.kv_lora_rank, config.qk_rope_head_dim, config.full_layer_ids)
    if key not in _PROBE:
        problem = None
        if api.MLATokenToKVPool is None:
            problem = "this SGLang has no MLATokenToKVPool"
        else:
            try:
                single_rank(api)
                pool = construct(api.HybridLinearKVPool, size=1, page_size=1, dtype=torch.bfloat16, head_num=1,
                                 head_dim=16, full_attention_layer_ids=list(config.full_layer_ids), device="cpu",
                                 mamba_pool=None, enable_memory_saver=False, enable_kvcache_transpose=False, use_mla=True,
                                 kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim)
                if not isinstance(pool.full_kv_pool, api.MLATokenToKVPool):
                    problem = (f"its HybridLinearKVPool(use_mla=True) builds a {type(pool.full_kv_pool).__name__} "
                               "sub-pool, not MLATokenToKVPool")
            except Exception as exc:  # a constructor without use_mla=, or one that refuses it here
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                problem = (f"SGLang {api.version} cannot build HybridLinearKVPool with an MLA sub-pool "
                           f"({type(exc).__name__}: {first})")
        _PROBE[key] = problem
    return _PROBE[key]


def build_hybrid_mla_pool(api: SGLangAPI, c: ModelConfig, mamba_pool, common: dict) -> tuple[object, list[Component]]:
    """The release's ``HybridLinearKVPool(use_mla=True)`` for the config, and its latent components."""
    single_rank(api)
    pool = construct(api.HybridLinearKVPool, size=c.full_tokens, full_attention_layer_ids=list(c.full_layer_ids),
                     mamba_pool=mamba_pool, use_mla=True, kv_lora_rank=c.kv_lora_rank,
                     qk_rope_head_dim=c.qk_rope_head_dim, **common)
    r = c.kv_lora_rank
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        # What an MLA backend reads from the hybrid pool by model layer id: ``get_kv_buffer``, the whole latent
        # row as K and its compressed part as V (views of the sub-pool's buffer, checked in place)
        row = read_door(pool, "get_key_buffer", layer_id, pool.full_kv_pool.kv_buffer[local])
        key, value = pool.get_kv_buffer(layer_id)
        if key.data_ptr() != row.data_ptr() or value.data_ptr() != row.data_ptr() or value.shape[-1] != r:
            raise ConfigError(f"config {c.name!r}: HybridLinearKVPool.get_kv_buffer({layer_id}) does not hand out "
                              "the MLA sub-pool's latent row (K) and its compressed part (V) in place")
        out.append(Component(name="mla.latent", layer=layer_id, space="full", tensor=value[:, 0, :]))
        out.append(Component(name="mla.rope", layer=layer_id, space="full", tensor=key[:, 0, r:]))
    return pool, out
