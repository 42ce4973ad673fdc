"""Block-scaled fp8 KV (MXFP8): K and V rows with their UE8M0 scale rows in buffers beside them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import Component, zeros
from poolfuzz.pools.kv import CPU_COPY_CHUNK, MHACpuCopy, MHATokenToKVPool
from poolfuzz.pools.mamba import cpu_copy


@dataclass(frozen=True, kw_only=True)
class ScaledCpuCopy:
    """The K/V rows, and per layer, per chunk, ``(k_scale, v_scale)`` of the same slots."""

    kv: MHACpuCopy
    scales: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]

    def __repr__(self) -> str:
        return f"ScaledCpuCopy(layers={len(self.scales)}, tokens={self.kv.num_tokens})"


class MHATokenToKVPoolScaled(MHATokenToKVPool):
    """SGLang's ``MHATokenToKVPoolMXFP8``: per layer ``k_scale_buffer[l]`` / ``v_scale_buffer[l]`` of
    ``[size+page_size, heads, head_dim / block]`` bytes, one scale per block of K or V values.

    Every path that moves K and V moves the scales too: the CPU copy, and PD, where they travel
    as the ``BLOCK_SCALE`` state type (items of one page, like the KV they describe). A slot
    restored without them dequantises against another request's exponents. No host pool has
    entries for them here, so retraction takes ``cpu_tensor``.
    """

    supports_host_pool_backup = False
    state_types = ("BLOCK_SCALE",)

    def __init__(self, *, scale_block: int, **kwargs):
        super().__init__(**kwargs)
        k = self.k_buffer[0]
        shape = (k.shape[0], k.shape[1], k.shape[2] // scale_block)
        self.scale_block = scale_block
        self.k_scale_buffer = [zeros(shape, dtype=torch.uint8, device=self.device) for _ in self.layer_ids]
        self.v_scale_buffer = [zeros(shape, dtype=torch.uint8, device=self.device) for _ in self.layer_ids]

    def components(self) -> list[Component]:
        out = super().components()
        for local, layer_id in enumerate(self.layer_ids):
            out.append(Component(name=f"{self.name}.k_scale", layer=layer_id, space=self.name,
                                 tensor=self.k_scale_buffer[local]))
            out.append(Component(name=f"{self.name}.v_scale", layer=layer_id, space=self.name,
                                 tensor=self.v_scale_buffer[local]))
        return out

    def get_cpu_copy(self, indices, mamba_indices=None) -> ScaledCpuCopy:
        # The scales travel with their fp8 payload (SGLang's MXFP8 override of the base copy).
        idx = as_index(indices).to(self.device)
        scales = tuple(tuple((cpu_copy(ks[idx[s:s + CPU_COPY_CHUNK]]), cpu_copy(vs[idx[s:s + CPU_COPY_CHUNK]]))
                             for s in range(0, idx.numel(), CPU_COPY_CHUNK))
                       for ks, vs in zip(self.k_scale_buffer, self.v_scale_buffer))
        return ScaledCpuCopy(kv=super().get_cpu_copy(idx), scales=scales)

    def load_cpu_copy(self, cpu: ScaledCpuCopy, indices, mamba_indices=None) -> None:
        idx = as_index(indices).to(self.device)
        super().load_cpu_copy(cpu.kv, idx)
        for ks, vs, chunks in zip(self.k_scale_buffer, self.v_scale_buffer, cpu.scales):
            for i, (k_cpu, v_cpu) in enumerate(chunks):
                part = idx[i * CPU_COPY_CHUNK:(i + 1) * CPU_COPY_CHUNK]
                ks[part] = k_cpu.to(self.device)
                vs[part] = v_cpu.to(self.device)

    def move_buffers(self) -> tuple[list[torch.Tensor], ...]:
        return super().move_buffers() + (self.k_scale_buffer, self.v_scale_buffer)  # scales move with K and V

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != "BLOCK_SCALE":
            return super().get_state_buf_infos(state_type)
        return self.k_scale_buffer + self.v_scale_buffer
