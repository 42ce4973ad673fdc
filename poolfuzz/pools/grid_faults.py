"""Faults off the named grid: sizes and shapes the named configs do not have (drawn configs reach them)."""

from __future__ import annotations

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.kv import MHATokenToKVPool
from poolfuzz.pools.mamba import MambaPool


class ReloadChunkAtChunkNumber(MHATokenToKVPool):
    """Reload of a chunked CPU copy (8192 positions a chunk, sglang#7409) slices the target slots at
    the chunk's *number*, not its first position: one chunk (every context up to 8192 tokens) is
    exact; past it, the second chunk overwrites positions 1.. of the first, the rest stay unloaded."""

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        idx = as_index(indices).to(self.device)
        for k, v, chunks in zip(self.k_buffer, self.v_buffer, cpu.layers):
            for i, (k_cpu, v_cpu) in enumerate(chunks):
                part = idx[i:i + k_cpu.shape[0]]
                k[part] = k_cpu.to(self.device)
                v[part] = v_cpu.to(self.device)


class MambaLayerMapAssumesContiguous(MambaPool):
    """Maps a model layer to its state tensor by offset from where the mamba layers would start if
    they were the last layers, not by its rank among them (sglang#20457's layer-id map, with its
    ``.get(layer_id, layer_id)`` style fallback): right for a blocked layout, but with mamba layers
    interleaved between attention layers two layers share one state tensor."""

    def local_layer(self, layer_id: int) -> int:
        return layer_id - (self.layer_ids[-1] + 1 - self.num_layers)
