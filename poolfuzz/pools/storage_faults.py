"""Catalogue faults of the MLA, DSA, MiniMax sparse and block-scaled KV pools: each drops or misplaces one buffer."""

from __future__ import annotations

import dataclasses

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.kv import CPU_COPY_CHUNK, HybridLinearKVPool
from poolfuzz.pools.latent import DSATokenToKVPool, MLATokenToKVPool, copy_rows
from poolfuzz.pools.minimax_sparse import MiniMaxSparseKVPool
from poolfuzz.pools.scaled import MHATokenToKVPoolScaled
from poolfuzz.pools.transfer import PDTransfer


class MLACopiesValueBufferOnly(MLATokenToKVPool):
    """The retraction copy reads each layer through ``get_value_buffer`` (``[..., :kv_lora_rank]``,
    the compressed KV) and restores only that: the rope part of a resumed request's rows is whatever
    their new slots held. The correct copy moves whole latent rows."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        r = self.kv_lora_rank
        return copy_rows([b[..., :r] for b in self.kv_buffer], as_index(indices).to(self.device), CPU_COPY_CHUNK)

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        r = self.kv_lora_rank
        idx = as_index(indices).to(self.device)
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


class DSAIndexScalesTransposed(DSATokenToKVPool):
    """The index cache restore lays each page's scale bytes out scale-major (byte 0 of every token,
    then byte 1, ...: a ``[scale bytes, page]`` view, as a kernel with a transposed scale layout
    reads them) instead of token-major: at page size 1 the two agree; on larger pages every token's
    scales hold bytes of its neighbours'. The keys are restored right."""

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        super().load_cpu_copy(cpu, indices)
        ps, d, s = self.page_size, self.index_head_dim, self.index_scale_bytes
        for buf in self.index_k_with_scale_buffer:
            pages = self.index_pages(indices)
            scales = buf[pages, ps * d:].reshape(-1, ps, s)
            buf[pages, ps * d:] = scales.transpose(1, 2).reshape(pages.numel(), -1)


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


class ScaledMoveWithoutScales(MHATokenToKVPoolScaled):
    """After a tree verify the accepted rows move with the base MHA pool's move, which knows nothing of
    scale buffers: the window's front gets the accepted fp8 K and V and keeps the first branch's scales
    (SGLang's MXFP8 pool overrides ``move_kv_cache`` so the scales travel with their payload)."""

    def move_buffers(self):
        return super(MHATokenToKVPoolScaled, self).move_buffers()


class TransferWithoutBlockScales(PDTransfer):
    """Appends ``BLOCK_SCALE`` only for the sub-pools of an SWA pool (as a PD setup that looks for
    MXFP8 scales in its SWA branch alone would), so a full-attention model's scales never cross to
    decode: the decode node dequantises the transferred K and V with its own stale scales."""

    def state_components(self, family):
        return [c for c in super().state_components(family) if c[0] != "BLOCK_SCALE"]


class MiniMaxCopySkipsKOnlyIndex(MiniMaxSparseKVPool):
    """The retraction copy carries the main K/V and the K+V index group (``index_kv_pool``) but not the K-only
    group's keys (``index_k_pool``, the layers of ``sparse_disable_index_value``), as a copy written before the
    K-only pool was split off would: a resumed request's K-only sparse layers select tokens by another
    request's index keys. The correct copy carries every sub-pool."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        return dataclasses.replace(super().get_cpu_copy(indices), index_k=None)


class HybridMLATransferItemOfHeadWidth(HybridLinearKVPool):
    """The hybrid pool registers its full-attention buffers for PD with the MHA item length it was built with
    (``head_num * head_dim`` values a token), as the MHA branch of ``HybridLinearKVPool`` would, although its
    sub-pool is MLA (Kimi-Linear): a token's item is not its latent row, so page N is read from, and written
    to, bytes of other tokens and across latent and rope parts. The correct registration is the sub-pool's
    own (``get_contiguous_buf_infos``: whole latent rows)."""

    def get_contiguous_buf_infos(self):
        width = self.head_num * self.head_dim
        # a registration is a base pointer and an item length: the buffer read as whole items of that width, the
        # bytes past the last whole one never addressed (a reshape of the whole buffer would fail loudly on shapes
        # where the widths do not divide, which no registration does)
        items = [b.view(-1) for b in self.full_kv_pool.get_contiguous_buf_infos()]
        return [flat[:flat.numel() // width * width].view(-1, width) for flat in items]
