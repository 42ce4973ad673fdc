"""Catalogue faults of the MLA, DSA and block-scaled KV pools: each drops or misplaces one buffer."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import _as_index
from poolfuzz.pools.kv import CPU_COPY_CHUNK
from poolfuzz.pools.latent import DSATokenToKVPool, MLATokenToKVPool, _copy_rows, _load_rows
from poolfuzz.pools.scaled import MHATokenToKVPoolScaled
from poolfuzz.pools.transfer import PDTransfer


class MLACopiesValueBufferOnly(MLATokenToKVPool):
    """The retraction copy reads each layer through ``get_value_buffer`` (``[..., :kv_lora_rank]``,
    the compressed KV) and restores only that: the rope part of a resumed request's rows is whatever
    their new slots held. The correct copy moves whole latent rows."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        r = self.kv_lora_rank
        return _copy_rows([b[..., :r] for b in self.kv_buffer], _as_index(indices).to(self.device), CPU_COPY_CHUNK)

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        r = self.kv_lora_rank
        idx = _as_index(indices).to(self.device)
        for buf, chunks in zip(self.kv_buffer, cpu.layers):
            for i, part in enumerate(chunks):
                buf[idx[i * CPU_COPY_CHUNK:(i + 1) * CPU_COPY_CHUNK], :, :r] = part.to(buf.device)


class MLATransferItemOfLatentWidth(MLATokenToKVPool):
    """PD registers each layer with an item length of ``kv_lora_rank`` values a token (the value
    buffer's width) instead of the whole latent row: page N is read from, and written to, the bytes
    at N items of the shorter length, which lie in other pages and across latent and rope parts."""

    def get_contiguous_buf_infos(self):
        r = self.kv_lora_rank
        return [b.view(-1).view(-1, r) for b in self.kv_buffer]


class DSACopyWithoutIndexCache(DSATokenToKVPool):
    """The retraction copy carries the latent rows only, as ``MLATokenToKVPool``'s does: the index
    pages are freed with the request and reused, so the resumed request's indexer reads another
    request's keys and scales (what SGLang's DSA ``get_cpu_copy`` offloads ``index_k`` for)."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        return MLATokenToKVPool.get_cpu_copy(self, indices)

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        MLATokenToKVPool.load_cpu_copy(self, cpu, indices)


class DSAIndexTokenMajor(DSATokenToKVPool):
    """The index cache restore lays each page out token-major (keys and scale of token 0, then of
    token 1, ...) instead of page-major (every key of the page, then every scale): at page size 1
    the two agree; on larger pages keys land in scale bytes and scales in other tokens' keys."""

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        MLATokenToKVPool.load_cpu_copy(self, cpu.kv, indices)
        ps, d, s = self.page_size, self.index_head_dim, self.index_scale_bytes
        token_major = [_token_major(chunks, ps, d, s) for chunks in cpu.index_k.layers]
        page_chunk = max(1, CPU_COPY_CHUNK // ps)
        _load_rows(self.index_k_with_scale_buffer, type(cpu.index_k)(layers=tuple(token_major),
                                                                      num_rows=cpu.index_k.num_rows),
                   self.index_pages(indices), page_chunk)


def _token_major(chunks, ps: int, d: int, s: int) -> tuple[torch.Tensor, ...]:
    out = []
    for pages in chunks:
        keys = pages[:, :ps * d].reshape(-1, ps, d)
        scales = pages[:, ps * d:].reshape(-1, ps, s)
        out.append(torch.cat([keys, scales], dim=2).reshape(pages.shape[0], -1))
    return tuple(out)


class TransferWithoutDSAState(PDTransfer):
    """Appends the state types of the pool's attention layout only (SWA, MAMBA), never ``DSA``: the
    decode node's index cache for the transferred pages stays as it was."""

    def state_components(self, family):
        return [c for c in super().state_components(family) if c[0] != "DSA"]


class ScaledCopyWithoutScales(MHATokenToKVPoolScaled):
    """The retraction copy is the base MHA pool's, which knows nothing of scale buffers: a resumed
    request's fp8 K and V come back, their block scales do not (what SGLang's MXFP8 pool overrides
    ``get_cpu_copy`` / ``load_cpu_copy`` for)."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        return super().get_cpu_copy(indices).kv

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        super(MHATokenToKVPoolScaled, self).load_cpu_copy(cpu, indices)


class TransferWithoutBlockScales(PDTransfer):
    """Appends ``BLOCK_SCALE`` only for the sub-pools of an SWA pool (as a PD setup that looks for
    MXFP8 scales in its SWA branch alone would), so a full-attention model's scales never cross to
    decode: the decode node dequantises the transferred K and V with its own stale scales."""

    def state_components(self, family):
        return [c for c in super().state_components(family) if c[0] != "BLOCK_SCALE"]
