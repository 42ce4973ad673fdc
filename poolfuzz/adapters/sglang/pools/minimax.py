"""SGLang's MiniMax sparse KV pool (``MiniMaxSparseKVPool``): its main K/V, its index caches, and their doors.

Built by SGLang's configurator (``_build_minimax_sparse_kv_pool``) for a MiniMax-M3 model: the dense and sparse
layer ids, and the sparse layers whose indexer keeps no value (``sparse_disable_index_value``), which SGLang stores
in its K-only pool (``MHATokenToKOnlyPool``). The harness writes through the attention
backend's door (``set_fused_kv_index_buffer`` for a sparse layer, which on a CPU falls back to the separate
``set_kv_buffer`` / ``set_index_kv_buffer`` / ``set_index_k_buffer`` stores; ``set_kv_buffer`` for a dense one)
and checksums what the kernels read (``get_key_buffer`` / ``get_value_buffer``, ``get_index_kv_buffer``,
``get_index_k_buffer``), so a pool that files an index row under another layer or sub-pool is caught.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable
from poolfuzz.adapters.sglang.pools.writes import as_pool_dtype, RadixAttentionFields, kv_write_loc
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

_POOL = "sglang.srt.mem_cache.memory_pool:MiniMaxSparseKVPool"


def msa_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """Why this release cannot build the config's MiniMax sparse pool, or None."""
    if first_importable(_POOL, required=False) is None:
        return f"SGLang {api.version} has no MiniMaxSparseKVPool (MiniMax sparse attention)"
    return None


def msa_components(pool, c: ModelConfig) -> list[Component]:
    """The components of the ``MiniMaxSparseKVPool`` SGLang's configurator built for the config's server."""
    return _components(pool, c)


def _sub_pool_buffers(pool) -> set[int]:
    out = set()
    for sub in (pool.main_pool, getattr(pool, "dense_pool", None), pool.index_kv_pool, pool.index_k_pool):
        for name in ("k_buffer", "v_buffer"):
            out |= {b.untyped_storage().data_ptr() for b in (getattr(sub, name, None) or [])}
    return out


def _in_place(pool, got: torch.Tensor, what: str) -> torch.Tensor:
    if got.untyped_storage().data_ptr() not in _sub_pool_buffers(pool):
        raise ConfigError(f"MiniMaxSparseKVPool.{what} hands out a copy, not a buffer of its sub-pools; poolfuzz "
                          "checksums what the kernels read in place")
    return got.view(torch.uint8) if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else got


def _components(pool, c: ModelConfig) -> list[Component]:
    """Main K and V of every layer, the index key of every sparse layer and the index value of the K+V group,
    each as the pool's read door hands it to the kernels."""
    out = []
    dense = set(c.msa_layer_ids("D"))
    for lid in c.full_layer_ids:
        # a dense layer's backend asks for K and V apart; the sparse backend for both at once
        k, v = ((pool.get_key_buffer(lid), pool.get_value_buffer(lid)) if lid in dense else pool.get_kv_buffer(lid))
        out.append(Component(name="full.k", layer=lid, space="full", tensor=_in_place(pool, k, f"K of layer {lid}")))
        out.append(Component(name="full.v", layer=lid, space="full", tensor=_in_place(pool, v, f"V of layer {lid}")))
        if lid in dense:
            continue
        # the index key as a caller that needs only K gets it (either group), the value from the K+V door
        out.append(Component(name="msa.index_k", layer=lid, space="full",
                             tensor=_in_place(pool, pool.get_index_k_buffer(lid), f"get_index_k_buffer({lid})")))
        if lid in c.msa_layer_ids("V"):
            ik, iv = pool.get_index_kv_buffer(lid)
            if ik.data_ptr() != out[-1].tensor.data_ptr():
                raise ConfigError(f"MiniMaxSparseKVPool's two index-key doors of layer {lid} hand out different "
                                  "buffers; poolfuzz checksums one")
            out.append(Component(name="msa.index_v", layer=lid, space="full",
                                 tensor=_in_place(pool, iv, f"get_index_kv_buffer({lid})")))
    return out


def write_msa_rows(pool, *, config: ModelConfig, slots: torch.Tensor, rows: dict) -> set:
    """Write ``rows[(component, layer)]`` for the slots through the pool's own doors, layer by layer, as the
    MiniMax sparse backend and the dense backend do; return the keys written."""
    if not rows:
        return set()
    device = next(iter(rows.values())).device
    loc = slots.to(device=device, dtype=torch.int64)
    dense_loc, dense_kwargs = kv_write_loc(pool, loc)
    kv_group, k_group = set(config.msa_layer_ids("V")), set(config.msa_layer_ids("K"))
    done = set()
    for lid in config.full_layer_ids:
        keys = {name: (name, lid) for name in ("full.k", "full.v", "msa.index_k", "msa.index_v")}
        if keys["full.k"] not in rows or keys["full.v"] not in rows:
            continue
        k, v = (as_pool_dtype(rows[keys[n]], pool) for n in ("full.k", "full.v"))
        if lid not in kv_group | k_group:
            pool.set_kv_buffer(RadixAttentionFields(lid), dense_loc, k, v, **dense_kwargs)
            done |= {keys["full.k"], keys["full.v"]}
            continue
        wanted = [keys["msa.index_k"]] + ([keys["msa.index_v"]] if lid in kv_group else [])
        if any(key not in rows for key in wanted):
            continue
        idx_k = as_pool_dtype(rows[keys["msa.index_k"]], pool)
        idx_v = as_pool_dtype(rows[keys["msa.index_v"]], pool) if lid in kv_group else None
        # The sparse backend's one call per layer (the backend hands out_cache_loc, a plain tensor); a release
        # without the fused door stores the parts one by one, as that door's fallback does.
        fused = getattr(pool, "set_fused_kv_index_buffer", None)
        if fused is not None:
            fused(RadixAttentionFields(lid), loc, k, v, idx_k, idx_v)
        else:
            pool.set_kv_buffer(RadixAttentionFields(lid), loc, k, v)
            if idx_v is None:
                pool.set_index_k_buffer(RadixAttentionFields(lid), loc, idx_k)
            else:
                pool.set_index_kv_buffer(RadixAttentionFields(lid), loc, idx_k, idx_v)
        done |= {keys["full.k"], keys["full.v"], *wanted}
    return done
