"""MiniMax sparse attention's KV pool (SGLang's ``MiniMaxSparseKVPool``): main K/V, and index caches beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import DTYPES, Component, zeros
from poolfuzz.pools.kv import CPU_COPY_CHUNK, KVCache, MHACpuCopy, MHATokenToKVPool
from poolfuzz.pools.latent import ChunkedCpuCopy, copy_rows, load_rows

INDEX_STATE = "MINIMAX_INDEX"  # the PD state type the index caches cross as (items: the request's KV pages)


@dataclass(frozen=True, kw_only=True)
class MiniMaxCpuCopy:
    """The main K/V rows, then the index rows of each group (keys and values; keys only)."""

    main: MHACpuCopy
    index_kv: ChunkedCpuCopy | None
    index_k: ChunkedCpuCopy | None

    def __repr__(self) -> str:
        return f"MiniMaxCpuCopy(tokens={self.main.num_tokens})"


class MiniMaxSparseKVPool(KVCache):
    """K and V of every layer (dense and sparse) in one MHA pool, by model layer id; beside each sparse layer a
    single-head index cache of ``index_head_dim`` values a token, addressed by the same slots: keys and values
    for the layers whose indexer reads values (``index_kv``), keys only for those of ``sparse_disable_index_value``
    (``index_k``; SGLang's ``MHATokenToKOnlyPool``).

    Every buffer is a component: ``full.k`` / ``full.v`` per layer, ``msa.index_k`` per sparse layer and
    ``msa.index_v`` per layer of the K+V group. The CPU copy, the accepted-token move and PD (main K/V by page,
    the index caches as the ``MINIMAX_INDEX`` state) carry all of them: a row restored without its index key has
    the sparse layer select another request's tokens."""

    state_types = (INDEX_STATE,)

    def __init__(self, *, size: int, page_size: int, dtype: str, head_num: int, head_dim: int,
                 layer_ids: tuple[int, ...], kv_sparse_layer_ids: tuple[int, ...],
                 k_only_layer_ids: tuple[int, ...], index_head_dim: int, device: torch.device,
                 kv_class: type | None = None):
        # kv_class: the main pool's class (SGLang's main_pool_cls), so a fault in it reaches here too
        self.page_size = page_size
        self.device = torch.device(device)
        self.main_pool = (kv_class or MHATokenToKVPool)(size=size, page_size=page_size, dtype=dtype, head_num=head_num,
                                          head_dim=head_dim, layer_ids=tuple(layer_ids), device=device)
        self.kv_sparse_layer_ids = tuple(kv_sparse_layer_ids)
        self.k_only_layer_ids = tuple(k_only_layer_ids)
        shape = (size + page_size, 1, index_head_dim)
        store = DTYPES[dtype]
        self.index_k = {lid: zeros(shape, dtype=store, device=self.device)
                        for lid in self.kv_sparse_layer_ids + self.k_only_layer_ids}
        self.index_v = {lid: zeros(shape, dtype=store, device=self.device) for lid in self.kv_sparse_layer_ids}

    def components(self) -> list[Component]:
        out = self.main_pool.components()
        for lid, buf in sorted(self.index_k.items()):
            out.append(Component(name="msa.index_k", layer=lid, space="full", tensor=buf))
            if lid in self.index_v:
                out.append(Component(name="msa.index_v", layer=lid, space="full", tensor=self.index_v[lid]))
        return out

    def index_buffers(self, group: str) -> list[torch.Tensor]:
        """One group's index buffers, in layer order: ``"kv"`` (keys then values, per layer) or ``"k"`` (keys)."""
        if group == "kv":
            return [b for lid in self.kv_sparse_layer_ids for b in (self.index_k[lid], self.index_v[lid])]
        return [self.index_k[lid] for lid in self.k_only_layer_ids]

    def get_cpu_copy(self, indices, mamba_indices=None) -> MiniMaxCpuCopy:
        idx = as_index(indices).to(self.device)
        kv, k = self.index_buffers("kv"), self.index_buffers("k")
        return MiniMaxCpuCopy(main=self.main_pool.get_cpu_copy(idx),
                              index_kv=copy_rows(kv, idx, CPU_COPY_CHUNK) if kv else None,
                              index_k=copy_rows(k, idx, CPU_COPY_CHUNK) if k else None)

    def load_cpu_copy(self, cpu: MiniMaxCpuCopy, indices, mamba_indices=None) -> None:
        idx = as_index(indices).to(self.device)
        self.main_pool.load_cpu_copy(cpu.main, idx)
        for group, saved in (("kv", cpu.index_kv), ("k", cpu.index_k)):
            if saved is not None:
                load_rows(self.index_buffers(group), saved, idx, CPU_COPY_CHUNK)

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        return self.main_pool.get_contiguous_buf_infos()

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """After a tree verify: main K/V and, in lockstep, every sparse layer's index rows."""
        self.main_pool.move_kv_cache(tgt_loc, src_loc)
        tgt, src = as_index(tgt_loc).to(self.device), as_index(src_loc).to(self.device)
        for buf in self.index_buffers("kv") + self.index_buffers("k"):
            buf[tgt] = buf[src]

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != INDEX_STATE:
            return super().get_state_buf_infos(state_type)
        return self.index_buffers("kv") + self.index_buffers("k")  # an item is a page of rows
