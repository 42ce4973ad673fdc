"""The KV cache tensors a vLLM worker would allocate for the manager's blocks (the manager owns none)."""

from __future__ import annotations

import torch

from poolfuzz.pools.components import DTYPES, Component, zeros
from poolfuzz.pools.config import ModelConfig


def attention_components(config: ModelConfig, space: str, layer_ids, num_blocks: int, device) -> list[Component]:
    """Per layer one ``[2, num_blocks, block_size, heads, head_dim]`` buffer (the flash-attention
    layout); K and V are its halves, addressed by slot ``block_id * block_size + offset`` as the
    worker's slot mapping addresses them. Block 0 is the null block: nothing may write it."""
    ps = config.page_size
    out = []
    for layer in layer_ids:
        buf = zeros((2, num_blocks, ps, config.head_num, config.head_dim), dtype=DTYPES[config.kv_dtype],
                    device=device)
        for half, name in enumerate(("k", "v")):
            out.append(Component(name=f"{space}.{name}", layer=layer, space=space,
                                 tensor=buf[half].view(num_blocks * ps, config.head_num, config.head_dim)))
    return out


def mamba_components(config: ModelConfig, num_blocks: int, device) -> list[Component]:
    """Per mamba layer its conv and temporal state, one row per block (vLLM stores state per block)."""
    dtype = DTYPES[config.state_dtype]
    out = []
    for layer in config.mamba_layer_ids:
        for i, shape in enumerate(config.conv_shapes):
            out.append(Component(name=f"mamba.conv{i}", layer=layer, space="mamba",
                                 tensor=zeros((num_blocks, *shape), dtype=dtype, device=device)))
        if config.has_temporal:  # a state of conv windows only has none (Inkling's short convolutions)
            out.append(Component(name="mamba.temporal", layer=layer, space="mamba",
                                 tensor=zeros((num_blocks, *config.temporal_shape), dtype=dtype, device=device)))
    return out


def null_block_written(components: list[Component], block_size_of) -> str | None:
    """Which component wrote into block 0 (vLLM's null block, padding inside every block table)."""
    for comp in components:
        rows = block_size_of(comp.space)
        if bool(comp.tensor[:rows].reshape(-1).ne(0).any()):
            return f"{comp.name} layer {comp.layer}"
    return None


def zero_rows(components: list[Component], space: str, unit: int) -> None:
    for comp in components:
        if comp.space == space:
            comp.tensor[unit] = 0


def zero_blocks(components: list[Component], blocks, rows: int) -> None:
    """The worker's zeroing of new blocks: every row of each block, in every component given."""
    for b in blocks:
        for comp in components:
            comp.tensor[b * rows:(b + 1) * rows] = 0


def copy_block(components: list[Component], space: str, src: int, dst: int, rows: int) -> None:
    """The worker's block copy: every component of ``space`` copies block ``src``'s rows into ``dst``'s."""
    for comp in components:
        if comp.space == space:
            comp.tensor[dst * rows:(dst + 1) * rows] = comp.tensor[src * rows:(src + 1) * rows]


__all__ = ["attention_components", "mamba_components", "null_block_written", "zero_rows", "copy_block", "zero_blocks", "torch"]
