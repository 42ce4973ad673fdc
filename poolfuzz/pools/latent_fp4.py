"""FP4 MLA KV (SGLang's ``MLATokenToKVPoolFP4``): packed 4-bit latent rows, and a block-scale row beside each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import Component, zeros
from poolfuzz.pools.kv import CPU_COPY_CHUNK
from poolfuzz.pools.latent import ChunkedCpuCopy, MLATokenToKVPool, copy_rows, latent_components, load_rows

FP4_SCALE_BLOCK = 16  # values per scale byte (SGLang's FP4MXBlock16: one UE8M0 scale per 16 fp4 values)


@dataclass(frozen=True, kw_only=True)
class FP4CpuCopy:
    """The packed latent rows and the scale rows of the same slots."""

    kv: ChunkedCpuCopy
    scales: ChunkedCpuCopy

    def __repr__(self) -> str:
        return f"FP4CpuCopy(rows={self.kv.num_rows})"


class MLATokenToKVPoolFP4(MLATokenToKVPool):
    """Per layer ``kv_buffer[l]`` of ``[size+page_size, 1, (kv_lora_rank + qk_rope_head_dim) / 2]`` bytes (two
    fp4 values a byte: the compressed part's, then the rope part's) and ``kv_scale_buffer[l]`` of
    ``[size+page_size, (kv_lora_rank + qk_rope_head_dim) / 16]`` bytes, one scale per block of 16 values.

    The packed parts and the scale row are three components. Every path that moves a latent row moves its
    scale row too (the CPU copy, the accepted-token move, PD as the ``BLOCK_SCALE`` state): a row restored
    without its scales dequantises against another token's."""

    state_types = ("BLOCK_SCALE",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        rows = self.kv_buffer[0].shape[0]
        self.kv_buffer = [zeros((rows, 1, width // 2), dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
        self.kv_scale_buffer = [zeros((rows, width // FP4_SCALE_BLOCK), dtype=torch.uint8, device=self.device)
                                for _ in self.layer_ids]

    def components(self) -> list[Component]:
        out = []
        for buf, scales, layer_id in zip(self.kv_buffer, self.kv_scale_buffer, self.layer_ids):
            out += latent_components(buf[:, 0], self.kv_lora_rank // 2, layer=layer_id)
            out.append(Component(name="mla.scale", layer=layer_id, space="full", tensor=scales))
        return out

    def get_cpu_copy(self, indices, mamba_indices=None) -> FP4CpuCopy:
        idx = as_index(indices).to(self.device)
        return FP4CpuCopy(kv=copy_rows(self.kv_buffer, idx, CPU_COPY_CHUNK),
                          scales=copy_rows(self.kv_scale_buffer, idx, CPU_COPY_CHUNK))

    def load_cpu_copy(self, cpu: FP4CpuCopy, indices, mamba_indices=None) -> None:
        idx = as_index(indices).to(self.device)
        load_rows(self.kv_buffer, cpu.kv, idx, CPU_COPY_CHUNK)
        load_rows(self.kv_scale_buffer, cpu.scales, idx, CPU_COPY_CHUNK)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        super().move_kv_cache(tgt_loc, src_loc)
        tgt, src = as_index(tgt_loc).to(self.device), as_index(src_loc).to(self.device)
        for scales in self.kv_scale_buffer:
            scales[tgt] = scales[src]

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != "BLOCK_SCALE":
            return super().get_state_buf_infos(state_type)
        return list(self.kv_scale_buffer)
