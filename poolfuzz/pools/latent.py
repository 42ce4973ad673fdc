"""MLA and DSA KV pools: one latent row per token (compressed KV, then rope), and DSA's index cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import DTYPES, Component, zeros
from poolfuzz.pools.attention_kinds import DSA_QUANT_BLOCK
from poolfuzz.pools.kv import CPU_COPY_CHUNK, KVCache
from poolfuzz.pools.mamba import cpu_copy


@dataclass(frozen=True, kw_only=True)
class ChunkedCpuCopy:
    """Per layer, per chunk of rows (8192 positions, or pages covering them), one CPU tensor."""

    layers: tuple[tuple[torch.Tensor, ...], ...]
    num_rows: int

    def __repr__(self) -> str:
        return f"ChunkedCpuCopy(layers={len(self.layers)}, rows={self.num_rows})"


def copy_rows(buffers, idx: torch.Tensor, chunk: int) -> ChunkedCpuCopy:
    """The rows ``idx`` of every buffer copied to the CPU, ``chunk`` rows a piece (as SGLang's ``get_cpu_copy``)."""
    return ChunkedCpuCopy(layers=tuple(tuple(cpu_copy(buf[idx[s:s + chunk]]) for s in range(0, idx.numel(), chunk))
                                       for buf in buffers), num_rows=idx.numel())


def load_rows(buffers, saved: ChunkedCpuCopy, idx: torch.Tensor, chunk: int) -> None:
    """Write a :func:`copy_rows` backup back into the rows ``idx`` of every buffer."""
    assert idx.numel() == saved.num_rows, f"load of {saved.num_rows} backed-up rows into {idx.numel()} rows"
    for buf, chunks in zip(buffers, saved.layers):
        for i, part in enumerate(chunks):
            buf[idx[i * chunk:(i + 1) * chunk]] = part.to(buf.device)


def latent_components(row: torch.Tensor, rank: int, *, layer: int, translate=None) -> list[Component]:
    """A layer's latent rows ``row`` (``[slots, width]``) as components: the compressed part (``mla.latent``, the first
    ``rank`` values) and, where the rows keep one, the rope part (``mla.rope``): a NoPE model's (GLM-5 Next's DSA
    layers) rows are the compressed part alone."""
    out = [Component(name="mla.latent", layer=layer, space="full", tensor=row[:, :rank], translate=translate)]
    if row.shape[-1] > rank:
        out.append(Component(name="mla.rope", layer=layer, space="full", tensor=row[:, rank:], translate=translate))
    return out


class MLATokenToKVPool(KVCache):
    """Per layer ``kv_buffer[l]`` of ``[size+page_size, 1, kv_lora_rank + qk_rope_head_dim]``: the
    compressed KV (what SGLang's ``get_value_buffer`` returns) then the rope part (none on a NoPE model), in one row.

    The two parts are two components, each checksummed on its own: a copy that carries one part
    and not the other is seen. No host pool mirrors it here, so retraction takes ``cpu_tensor``.
    """

    def __init__(self, *, size: int, page_size: int, dtype: str, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_ids: tuple[int, ...], device: torch.device, **_mha_args):
        self.size = size
        self.page_size = page_size
        self.store_dtype = DTYPES[dtype]
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.layer_ids = tuple(layer_ids)
        self.device = torch.device(device)
        shape = (size + page_size, 1, kv_lora_rank + qk_rope_head_dim)
        self.kv_buffer = [zeros(shape, dtype=self.store_dtype, device=self.device) for _ in self.layer_ids]

    def components(self) -> list[Component]:
        return [comp for buf, layer_id in zip(self.kv_buffer, self.layer_ids)
                for comp in latent_components(buf[:, 0], self.kv_lora_rank, layer=layer_id)]

    def get_cpu_copy(self, indices, mamba_indices=None) -> ChunkedCpuCopy:
        return copy_rows(self.kv_buffer, as_index(indices).to(self.device), CPU_COPY_CHUNK)

    def load_cpu_copy(self, cpu: ChunkedCpuCopy, indices, mamba_indices=None) -> None:
        load_rows(self.kv_buffer, cpu, as_index(indices).to(self.device), CPU_COPY_CHUNK)

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        """One buffer per layer (MLA has no separate V); an item is a page of whole latent rows."""
        return list(self.kv_buffer)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """After a tree verify: whole latent rows (compressed and rope parts) move, every layer."""
        tgt, src = as_index(tgt_loc).to(self.device), as_index(src_loc).to(self.device)
        for buf in self.kv_buffer:
            buf[tgt] = buf[src]


@dataclass(frozen=True, kw_only=True)
class DSACpuCopy:
    """SGLang's ``{"kv": ..., "index_k": ...}``: the latent rows and the index cache's pages."""

    kv: ChunkedCpuCopy
    index_k: ChunkedCpuCopy

    def __repr__(self) -> str:
        return f"DSACpuCopy(tokens={self.kv.num_rows}, index_pages={self.index_k.num_rows})"


class DSATokenToKVPool(MLATokenToKVPool):
    """MLA plus the DSA indexer's cache, per layer ``[pages, page_size * (index_head_dim + scale bytes)]``
    of bytes: each page holds the fp8 index keys of its tokens, then their float32 scales (one per
    ``DSA_QUANT_BLOCK`` key values), as SGLang's ``IndexKeyCache`` lays it out. Keys and scales are
    two page-major components. The cache is copied and transferred by the page; PD moves it as
    the ``DSA`` state type."""

    state_types = ("DSA",)

    def __init__(self, *, index_head_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.index_head_dim = index_head_dim
        self.index_scale_bytes = index_head_dim // DSA_QUANT_BLOCK * 4
        ps = self.page_size
        pages = self.kv_buffer[0].shape[0] // ps
        self.index_k_with_scale_buffer = [
            zeros((pages, ps * (index_head_dim + self.index_scale_bytes)), dtype=torch.uint8, device=self.device)
            for _ in self.layer_ids]

    def index_parts(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [pages, page_size, index_head_dim], scales [pages, page_size, scale bytes])``: views."""
        ps, key_bytes = self.page_size, self.page_size * self.index_head_dim
        return buf[:, :key_bytes].view(-1, ps, self.index_head_dim), buf[:, key_bytes:].view(-1, ps, self.index_scale_bytes)

    def components(self) -> list[Component]:
        out = super().components()
        for buf, layer_id in zip(self.index_k_with_scale_buffer, self.layer_ids):
            keys, scales = self.index_parts(buf)
            out.append(Component(name="dsa.index_k", layer=layer_id, space="full", tensor=keys,
                                 page_size=self.page_size))
            out.append(Component(name="dsa.index_scale", layer=layer_id, space="full", tensor=scales,
                                 page_size=self.page_size))
        return out

    def index_pages(self, indices) -> torch.Tensor:
        """The index-cache pages of a request's token slots (page-aligned runs, as the allocator gives)."""
        idx = as_index(indices).to(self.device)
        return idx[::self.page_size] // self.page_size

    def get_cpu_copy(self, indices, mamba_indices=None) -> DSACpuCopy:
        # Retraction frees the index pages too; without them a resumed request reads another's keys.
        page_chunk = max(1, CPU_COPY_CHUNK // self.page_size)
        return DSACpuCopy(kv=super().get_cpu_copy(indices),
                          index_k=copy_rows(self.index_k_with_scale_buffer, self.index_pages(indices), page_chunk))

    def load_cpu_copy(self, cpu: DSACpuCopy, indices, mamba_indices=None) -> None:
        super().load_cpu_copy(cpu.kv, indices)
        page_chunk = max(1, CPU_COPY_CHUNK // self.page_size)
        load_rows(self.index_k_with_scale_buffer, cpu.index_k, self.index_pages(indices), page_chunk)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """The latent rows and, in lockstep, each token's index keys and scales inside its page."""
        super().move_kv_cache(tgt_loc, src_loc)
        tgt, src = as_index(tgt_loc).to(self.device), as_index(src_loc).to(self.device)
        ps = self.page_size
        for buf in self.index_k_with_scale_buffer:
            for part in self.index_parts(buf):
                part[tgt // ps, tgt % ps] = part[src // ps, src % ps]

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != "DSA":
            return super().get_state_buf_infos(state_type)
        return list(self.index_k_with_scale_buffer)  # an item is one page of keys and scales
