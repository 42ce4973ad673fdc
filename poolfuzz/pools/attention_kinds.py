"""How a config's full-attention KV is stored: one registry from an attention kind to its rules and its pools.

A config names its kind (``ModelConfig.attention``); what follows from the kind is decided here, once, the way vLLM
maps a KV cache spec to its single-type manager: whether rows are MLA latent rows, which config fields the kind
needs and how they are checked, and which of a blueprint's KV pool classes a model of that kind is built with (alone,
and beside recurrent layers) with the arguments that class takes beyond the shared ones. A new storage kind is one
entry here and its pool module, not an ``if attention == ...`` in every builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# A ``poolfuzz.pools.config.ModelConfig``: config.py imports this module to validate one, so it is not imported here.
ModelConfig = Any

DSA_QUANT_BLOCK = 16  # index-key values per float32 scale (SGLang: 128; small here so rows stay small)


def _no_rules(c: ModelConfig) -> list[str]:
    return []


def _no_args(c: ModelConfig) -> dict:
    return {}


def _mha_rules(c: ModelConfig) -> list[str]:
    """Per-head K and V: FP4 rows need whole scale blocks of a token's K, enough of them to carry a tag."""
    if c.kv_quant == "fp4_mx_block16" and (c.head_dim % 2 or (c.head_num * c.head_dim) % 16
                                           or c.head_num * c.head_dim // 16 < 12):
        return ["kv_quant 'fp4_mx_block16' on MHA needs an even head_dim and head_num*head_dim a multiple of 16 of "
                "at least 192 values (a scale byte per 16 values of a token's K; its 12 scale bytes carry a tag)"]
    return []


def _mla_rules(c: ModelConfig) -> list[str]:
    problems = _latent_rules(c)
    if c.kv_quant == "fp4_mx_block16" and (c.kv_lora_rank % 32 or c.qk_rope_head_dim % 32
                                           or (c.kv_lora_rank + c.qk_rope_head_dim) // 16 < 12):
        problems.append("kv_quant 'fp4_mx_block16' on MLA needs kv_lora_rank and qk_rope_head_dim multiples of 32 "
                        "(16-value scale blocks, two values a byte) and at least 192 values a row (its 12 scale "
                        "bytes carry a tag)")
    return problems


def _latent_rules(c: ModelConfig) -> list[str]:
    """MLA and DSA rows: a compressed-KV part and a rope part (none on a NoPE model), each carrying a tag."""
    problems = []
    # MLA beside recurrent layers is Kimi-Linear's shape (SGLang's HybridLinearKVPool with use_mla; use_dsa too)
    if c.has_swa or (c.has_mamba and c.kv_quant):
        problems.append(f"attention {c.attention!r} is built for full-attention-only models here, and unquantised "
                        "also beside mamba layers (swa_layers must be 0; mamba_layers 0 with a kv_quant)")
    if c.kv_lora_rank < 12 or (c.qk_rope_head_dim < 12 and c.qk_rope_head_dim != 0):
        problems.append(f"kv_lora_rank ({c.kv_lora_rank}) and qk_rope_head_dim ({c.qk_rope_head_dim}) must each be "
                        ">= 12 (each part of a latent row carries a tag), or qk_rope_head_dim 0 for rows without a "
                        "rope part (NoPE)")
    return problems


def _dsa_rules(c: ModelConfig) -> list[str]:
    problems = _latent_rules(c)
    if c.index_head_dim % DSA_QUANT_BLOCK or c.index_head_dim // DSA_QUANT_BLOCK * 4 < 12:
        problems.append(f"index_head_dim ({c.index_head_dim}) must be a multiple of {DSA_QUANT_BLOCK} "
                        f"and at least {3 * DSA_QUANT_BLOCK} (its scales carry a tag)")
    return problems


def _msa_rules(c: ModelConfig) -> list[str]:
    """MiniMax sparse attention: full-attention MHA layers only, each dense or sparse (index K+V, or K only)."""
    problems = []
    if c.has_swa or c.has_mamba or c.kv_quant or c.kv_scale_block:
        problems.append("attention 'msa' is built for full-attention MHA models here (no SWA or mamba layers, "
                        "no kv_quant or kv_scale_block)")
    if len(c.msa_layers) != c.full_layers or set(c.msa_layers) - set("DVK") or not set(c.msa_layers) & set("VK"):
        problems.append(f"msa_layers {c.msa_layers!r} must give one letter per full-attention layer "
                        f"({c.full_layers}): D dense, V sparse with index K and V, K sparse with index K only; "
                        "at least one sparse")
    if c.index_head_dim < 12:
        problems.append(f"index_head_dim ({c.index_head_dim}) must be >= 12 (an index row carries a tag)")
    return problems


def _latent_args(c: ModelConfig) -> dict:
    return dict(kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim)


def _dsa_args(c: ModelConfig) -> dict:
    return _latent_args(c) | dict(index_head_dim=c.index_head_dim)


def _msa_args(c: ModelConfig) -> dict:
    return dict(kv_sparse_layer_ids=c.msa_layer_ids("V"), k_only_layer_ids=c.msa_layer_ids("K"),
                index_head_dim=c.index_head_dim)


@dataclass(frozen=True, kw_only=True)
class AttentionKind:
    """One way of storing full-attention KV, and everything a builder or validator asks of it."""

    name: str  # ``ModelConfig.attention``
    latent: bool = False  # one MLA latent row per token (the compressed KV, then the rope part), not per-head K and V
    # the Blueprint field of the KV pool a full-attention model of this kind is built with, per kv_quant ("" none);
    # None for the per-head MHA pool, whose class also depends on scale blocks (``Blueprint.token_kv_pool``)
    pools: dict[str, str] | None = None
    # the Blueprint field of the full-attention sub-pool beside recurrent layers; None: the per-head MHA pool
    beside_recurrent: str | None = None
    kv_quants: tuple[str, ...] = ()  # the KV quant methods (``kv_quant``) its pools are built with
    scale_blocks: bool = False  # fp8 KV with block scales beside it (``kv_scale_block``, MXFP8)
    sliding_window: bool = False  # its layers may be sliding-window ones (SWA pools keep per-head K and V)
    # its pool keeps per-head K and V in a per-token MHA pool it is handed (``kv_class``: MiniMax sparse)
    holds_token_pool: bool = False
    rules: Callable[[ModelConfig], list[str]] = _no_rules  # what the kind needs of a config's fields
    pool_args: Callable[[ModelConfig], dict] = _no_args  # what its pool class takes beyond the shared arguments


KINDS: dict[str, AttentionKind] = {k.name: k for k in (
    AttentionKind(name="mha", kv_quants=("cpu_fp8_e4m3", "fp4_mx_block16"), scale_blocks=True, sliding_window=True,
                  rules=_mha_rules),
    AttentionKind(name="mla", latent=True, pools={"": "mla_kv_pool", "fp4_mx_block16": "mla_fp4_kv_pool"},
                  kv_quants=("fp4_mx_block16",), beside_recurrent="mla_kv_pool", rules=_mla_rules,
                  pool_args=_latent_args),
    AttentionKind(name="dsa", latent=True, pools={"": "dsa_kv_pool"}, beside_recurrent="dsa_kv_pool", rules=_dsa_rules,
                  pool_args=_dsa_args),
    AttentionKind(name="msa", pools={"": "msa_kv_pool"}, holds_token_pool=True, rules=_msa_rules, pool_args=_msa_args),
)}
ATTENTIONS = tuple(KINDS)


def kind_of(c: ModelConfig) -> AttentionKind:
    """The attention kind ``c`` names (a valid config names one of ``KINDS``)."""
    return KINDS[c.attention]
