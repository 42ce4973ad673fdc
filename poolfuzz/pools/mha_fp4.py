"""FP4 MHA KV (SGLang's ``--kv-cache-dtype fp4_mx_block16`` on an MHA model): packed 4-bit K and V rows, and a
block-scale row beside each."""

from __future__ import annotations

import torch

from poolfuzz.pools.components import zeros
from poolfuzz.pools.latent_fp4 import FP4_SCALE_BLOCK
from poolfuzz.pools.scaled import MHATokenToKVPoolScaled


class MHATokenToKVPoolFP4(MHATokenToKVPoolScaled):
    """Per layer ``k_buffer[l]`` / ``v_buffer[l]`` of ``[size+page_size, heads, head_dim / 2]`` bytes (two fp4 values
    a byte) and ``k_scale_buffer[l]`` / ``v_scale_buffer[l]`` of ``[size+page_size, heads * head_dim / 16]`` bytes,
    one scale per block of 16 values of the token's K (or V) across its heads: SGLang's ``MHATokenToKVPoolFP4``
    and the buffers its ``FP4MXBlock16KVCacheMethod`` gives an ``MHATokenToKVPool``.

    K, V and their two scale rows are four components. Every path that moves K and V moves the scales too (the
    CPU copy, the accepted-token move, PD as the ``BLOCK_SCALE`` state): a row restored without its scales
    dequantises against another token's."""

    def __init__(self, **kwargs):
        super().__init__(scale_block=FP4_SCALE_BLOCK, **kwargs)
        rows, heads, dim = self.k_buffer[0].shape
        self.k_buffer = [zeros((rows, heads, dim // 2), dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
        self.v_buffer = [zeros((rows, heads, dim // 2), dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
        scales = (rows, heads * dim // FP4_SCALE_BLOCK)
        self.k_scale_buffer = [zeros(scales, dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
        self.v_scale_buffer = [zeros(scales, dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
