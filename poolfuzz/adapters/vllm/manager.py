"""A vLLM KVCacheManager for one poolfuzz config: one KV cache group per kind of layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from poolfuzz.adapters.vllm.api import VllmAPI
from poolfuzz.pools.capabilities import PoolsOrigin
from poolfuzz.pools.components import DTYPES
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

# Who builds a vLLM family's pools (every example alike): vLLM's own manager and block pool, over KV cache groups the
# adapter lays out from the config (layout_for); vLLM's planner (get_kv_cache_configs) does not run.
VLLM_POOLS = PoolsOrigin(built_by="adapter", detail="vLLM's KVCacheManager over the KV cache groups the adapter lays "
                         "out (layout_for), not vLLM's get_kv_cache_configs")


@dataclass(frozen=True, kw_only=True)
class Group:
    """One KV cache group: the harness space it is seen as, its layers and its block size."""

    index: int
    space: str  # "full", "swa" or "mamba"
    layer_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, kw_only=True)
class Built:
    manager: object  # vllm KVCacheManager
    groups: tuple[Group, ...]
    num_blocks: int  # block 0 is the null block
    hash_block_size: int  # the tokens each block hash covers (the page size, or finer: sub-block hits)
    max_model_len: int
    caching: bool


def num_blocks_for(config: ModelConfig) -> int:
    """One shared pool for every group: the config's full pages plus its mamba slots, plus the null
    block. The SWA group draws from the same pages (vLLM has no separate SWA pool), so a hybrid
    model's pool fills up about twice as fast as a dense one's: where prefix-cache eviction and
    reuse happen."""
    ps = config.page_size
    return config.full_tokens // ps + config.mamba_slots + 1


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a server's KV cache is for one config: its groups, their KVCacheConfig and the sizes the
    manager (or the scheduler above it) is built with."""

    groups: tuple[Group, ...]
    kv_cache_config: object  # vllm KVCacheConfig
    num_blocks: int  # block 0 is the null block
    hash_block_size: int
    scheduler_block_size: int
    max_model_len: int
    caching: bool


def layout_for(api: VllmAPI, config: ModelConfig, mamba_mode: str) -> Layout:
    """The KV cache groups over FullAttentionSpec / SlidingWindowSpec / MambaSpec, in one KVCacheConfig."""
    ps = config.page_size
    # Mamba "none" mode keeps one state block per request (block size = the longest request) and
    # vLLM runs such hybrids without prefix caching; "align" keeps a state per block of tokens.
    # The harness lets a request grow to the whole pool, plus a few draft tokens: vLLM's length cap
    # (max_model_len) must not cut it first.
    longest = _round_up(max(config.max_context, num_blocks_for(config) * ps) + 8, ps)
    mamba_block = ps if mamba_mode == "align" else longest
    dtype = torch.bfloat16 if DTYPES[config.kv_dtype] is torch.uint8 else DTYPES[config.kv_dtype]
    attn = dict(block_size=ps, num_kv_heads=config.head_num, head_size=config.head_dim, dtype=dtype)
    specs, groups = [], []
    specs.append((api.FullAttentionSpec(**attn), "full", config.full_layer_ids, ps))
    if config.has_swa:
        # vLLM keeps the last ``sliding_window - 1`` tokens before the one computed; poolfuzz's window
        # is the ``sliding_window`` tokens before it, so vLLM's window is one larger.
        specs.append((api.SlidingWindowSpec(**attn, sliding_window=config.sliding_window + 1), "swa",
                      config.swa_layer_ids, ps))
    if config.has_mamba:
        state_dtype = DTYPES[config.state_dtype]
        shapes = tuple(tuple(s) for s in config.conv_shapes) + (tuple(config.temporal_shape),)
        kw = dict(block_size=mamba_block, shapes=shapes, dtypes=(state_dtype,) * len(shapes))
        if "mamba_cache_mode" in api.mamba_fields:
            kw["mamba_cache_mode"] = mamba_mode
        specs.append((api.MambaSpec(**kw), "mamba", config.mamba_layer_ids, mamba_block))
    # vLLM orders the groups as their kind first appears in the model's layers (its planner groups
    # layers by spec in layer order): the order the coordinator then walks them in.
    # (state kept in the attention layers themselves comes after their KV: its first layer is theirs)
    specs.sort(key=lambda item: (min(item[2], default=0), item[1] == "mamba"))
    for i, (spec, space, layer_ids, block) in enumerate(specs):
        groups.append(Group(index=i, space=space, layer_ids=tuple(layer_ids), block_size=block))
    num_blocks = num_blocks_for(config)
    caching = not (config.has_mamba and mamba_mode == "none")
    scheduler_block = math.lcm(*(g.block_size for g in groups))
    extra = {}
    # An align hybrid on multi-token pages hashes every token, as a server started with
    # ``--prefix-match-unit 1`` does, where the release takes hits inside a block: a hit then ends at
    # the prompt's last token boundary (its state checkpointed there), and the hit's tail block is
    # copied on write in every group. Single-token pages and other configs hash by the block.
    hash_block = hash_block_for(api, config, mamba_mode)
    sparse = config.has_swa or (config.has_mamba and mamba_mode == "align")
    if caching and sparse and ps > 1 and "prefix_cache_retention_interval" in api.kv_cache_config_fields:
        # Multi-token pages run vLLM's sparse prefix-cache retention (SWA and mamba groups keep one
        # cached tail per two-block segment, plus each prompt's replay boundary); single-token pages
        # keep every block (dense, vLLM's default): both ways are driven.
        extra["prefix_cache_retention_interval"] = 2 * scheduler_block
    kv_cache_config = api.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[api.KVCacheGroupSpec([f"{g.space}.{lid}" for lid in g.layer_ids] or [f"{g.space}"], spec)
                         for g, (spec, *_) in zip(groups, specs)], **extra)
    return Layout(groups=tuple(groups), kv_cache_config=kv_cache_config, num_blocks=num_blocks,
                  hash_block_size=hash_block, scheduler_block_size=scheduler_block, max_model_len=longest,
                  caching=caching)


def build_manager(api: VllmAPI, config: ModelConfig, mamba_mode: str) -> Built:
    """The real KVCacheManager over the config's KV cache groups (``layout_for``)."""
    ps = config.page_size
    layout = layout_for(api, config, mamba_mode)
    caching, hash_block = layout.caching, layout.hash_block_size
    # As a scheduler that logs stats and publishes KV events (to a KV-aware router) builds it: the
    # family drains both every step and checks the events against the prefix cache.
    wanted = dict(kv_cache_config=layout.kv_cache_config, max_model_len=layout.max_model_len, enable_caching=caching,
                  scheduler_block_size=layout.scheduler_block_size, hash_block_size=hash_block, log_stats=True,
                  enable_kv_cache_events=caching)
    if ps == 1 and not (config.has_swa or config.has_mamba):
        # A dense model on single-token pages speculates as EAGLE does (the manager drops the last
        # block of every prefix hit, whose KV the draft model recomputes); the others as before, so
        # the hand-made #44409 and next-turn scenarios keep their hit lengths.
        wanted["use_eagle"] = True
    if api.metrics_collector is not None:
        # KV cache metrics on (the scheduler's --kv-cache-metrics), every block sampled: deterministic
        wanted["metrics_collector"] = api.metrics_collector(1.0)
    kwargs = {k: v for k, v in wanted.items() if k in api.manager_params}
    manager = api.KVCacheManager(**kwargs)
    if hash_block < ps and not getattr(manager.coordinator, "enable_partial_hash_hits", False):
        raise ConfigError(f"vLLM {api.version} hashes finer than a block but takes no hit inside one for "
                          f"{config.name!r}: the vllm adapter's probe (VllmAPI.partial_hash_hits) needs updating")
    return Built(manager=manager, groups=layout.groups, num_blocks=layout.num_blocks,
                 max_model_len=layout.max_model_len, caching=caching, hash_block_size=hash_block)


def hash_block_for(api: VllmAPI, config: ModelConfig, mamba_mode: str) -> int:
    """The tokens a block hash covers: one for an align hybrid on multi-token pages where the release
    takes hits inside a block, else the page size (see ``build_manager``)."""
    ps = config.page_size
    if ps > 1 and config.has_mamba and mamba_mode == "align" and api.partial_hash_hits:
        return 1
    return ps


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
