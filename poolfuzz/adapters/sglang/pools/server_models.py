"""The models that stand for the configs' architectures on the configurator path: each a ``config.json`` SGLang reads
(no weights), with the shapes, layers and dtypes of the config, and the flags its GPU server names beside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.quantised import MODEL_DTYPE

# The KV dtype flag for each config dtype: a float dtype is the model's own (``--kv-cache-dtype auto``).
_MODEL_DTYPES = ("bfloat16", "float16", "float32")


def dtype_flags(c: ModelConfig) -> tuple[str, dict]:
    """(the model's dtype, the KV dtype flag): a float KV dtype is the model's; FP8 and FP4 are asked by flag."""
    if c.kv_dtype in _MODEL_DTYPES and not c.kv_quant and not c.kv_scale_block:
        return c.kv_dtype, {}
    if c.kv_quant == "fp4_mx_block16":
        return c.kv_dtype if c.kv_dtype in _MODEL_DTYPES else "bfloat16", {"kv_cache_dtype": "fp4_mx_block16"}
    # an FP8 KV cache's model: poolfuzz's model dtype for quantised KV (float16, in which every fp8 byte round-trips)
    model = str(MODEL_DTYPE).removeprefix("torch.")
    if c.kv_scale_block:
        return model, {"kv_cache_dtype": "mxfp8"}
    return model, {"kv_cache_dtype": c.kv_dtype}  # fp8_e4m3 / fp8_e5m2 (cpu_fp8_e4m3: SGLang's CPU quant)


def _attention(c: ModelConfig, dtype: str) -> dict:
    """A decoder's attention fields, as a Llama-shaped ``config.json`` names them."""
    return {"num_hidden_layers": c.num_layers, "num_attention_heads": c.head_num,
            "num_key_value_heads": c.head_num, "head_dim": c.head_dim, "hidden_size": c.head_num * c.head_dim,
            "intermediate_size": 4 * c.head_num * c.head_dim, "vocab_size": 256,
            "max_position_embeddings": c.max_context, "torch_dtype": dtype,
            # token ids inside the small vocabulary (a model's defaults name ids past it, and transformers warns)
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _dense_model(c: ModelConfig, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_attention(c, dtype)}


def _gpt_oss_model(c: ModelConfig, dtype: str) -> dict:
    """GPT-OSS: sliding-window and full-attention layers as its ``layer_types`` name them (SGLang's
    ``get_hybrid_layer_ids`` reads them), with one expert per layer. Its ``sliding_window`` counts HF's way, the
    current token included: SGLang serves one less (``get_attention_sliding_window_size``), so the checkpoint names
    the config's window plus one, and the server's window is the config's."""
    layer_types = ["sliding_attention" if i in c.swa_layer_ids else "full_attention" for i in range(c.num_layers)]
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **_attention(c, dtype),
            "sliding_window": c.sliding_window + 1, "layer_types": layer_types, "num_local_experts": 1,
            "num_experts_per_tok": 1,
            # GPT-OSS's YaRN scaling, its pre-YaRN context the config's over the factor (the default 4096 against a
            # short context made transformers warn at every build of the model); the factor is exactly that ratio, as
            # transformers checks (a drawn context that is no multiple of 32 made it warn too)
            "rope_scaling": _yarn(c.max_context)}


def _yarn(context: int, factor: int = 32) -> dict:
    original = max(1, context // factor)
    return {"rope_type": "yarn", "factor": context / original, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": original}


def _qwen3_next_model(c: ModelConfig, dtype: str) -> dict:
    """Qwen3-Next: gated delta-net layers with a full-attention layer every ``full_attention_interval`` (the last of
    each interval, so the config's count of each is kept, not its order); the recurrent state is heads x head_dim x
    key head_dim, its conv rows the query, key and value widths together."""
    heads, head_dim, key_dim = c.temporal_shape
    interval = c.num_layers // max(c.full_layers, 1)
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **_attention(c, dtype),
            "full_attention_interval": interval, "linear_num_value_heads": heads, "linear_value_head_dim": head_dim,
            "linear_num_key_heads": 1, "linear_key_head_dim": key_dim,
            "linear_conv_kernel_dim": c.conv_shapes[0][1] + 1, "num_experts": 0, "mamba_chunk_size": 4,
            "mamba_ssm_dtype": c.state_dtype}


def _deepseek_v3_model(c: ModelConfig, dtype: str) -> dict:
    """DeepSeek-V3: multi-head latent attention (its latent rank and rope width are the config's), every layer dense
    (``first_k_dense_replace`` past the last layer, so no experts are read)."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **_attention(c, dtype),
            "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": c.qk_rope_head_dim,
            "qk_nope_head_dim": c.head_dim, "v_head_dim": c.head_dim, "first_k_dense_replace": c.num_layers,
            "n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 16, "rope_scaling": None}


def _deepseek_v32_model(c: ModelConfig, dtype: str) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3 with its sparse attention's indexer (``index_topk``, the config's index width),
    which SGLang's ``is_deepseek_dsa`` asks for."""
    return {**_deepseek_v3_model(c, dtype), "index_topk": 4, "index_head_dim": c.index_head_dim, "index_n_heads": 1}


def _kimi_linear_model(c: ModelConfig, dtype: str) -> dict:
    """Kimi-Linear: MLA layers between KDA (recurrent) ones, as its ``linear_attn_config`` names them (layers counted
    from 1); the KDA state is heads x head_dim x head_dim, and its conv state one kernel-major tensor, (kernel - 1)
    x the query, key and value widths."""
    heads, head_dim, _ = c.temporal_shape
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_attention(c, dtype),
            "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": c.qk_rope_head_dim,
            "qk_nope_head_dim": c.head_dim, "v_head_dim": c.head_dim, "num_experts": None,
            "linear_attn_config": {"kda_layers": [i + 1 for i in c.mamba_layer_ids],
                                   "full_attn_layers": [i + 1 for i in c.full_layer_ids], "num_heads": heads,
                                   "head_dim": head_dim, "short_conv_kernel_size": c.conv_shapes[0][0] + 1}}


def _glm5_next_model(c: ModelConfig, dtype: str) -> dict:
    """GLM-5 Next (``Glm5NextForConditionalGeneration``, its text model): DSA layers (MLA latent rows and the
    indexer's keys, ``index_topk`` and the config's index width, which SGLang's ``is_deepseek_dsa`` asks for) between
    KDA (recurrent) ones, as its ``linear_attn_config`` names them (layers counted from 0, unlike Kimi-Linear's); the
    KDA state is Kimi-Linear's (``KimiLinearStateShape``: heads x head_dim x head_dim, one kernel-major conv tensor),
    its heads, head dim and kernel also the text model's ``linear_*`` fields. Every layer dense
    (``first_k_dense_replace`` past the last layer), no MTP draft layers, no vision tower."""
    heads, head_dim, _ = c.temporal_shape
    kernel = c.conv_shapes[0][0] + 1
    text = {"model_type": "glm5_next_text", **_attention(c, dtype), "kv_lora_rank": c.kv_lora_rank,
            # its query low-rank width an int (transformers' strict field; no pool reads it): the latent rank's
            "q_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim, "qk_nope_head_dim": c.head_dim,
            "v_head_dim": c.head_dim, "index_topk": 4, "index_head_dim": c.index_head_dim, "index_n_heads": 1,
            "index_kpool": 1, "first_k_dense_replace": c.num_layers, "n_routed_experts": 1, "num_experts_per_tok": 1,
            "moe_intermediate_size": 16, "num_nextn_predict_layers": 0, "linear_num_heads": heads,
            "linear_head_dim": head_dim, "linear_conv_kernel_dim": kernel,
            "linear_attn_config": {"kda_layers": list(c.mamba_layer_ids), "full_attn_layers": list(c.full_layer_ids),
                                   "num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": kernel}}
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "torch_dtype": dtype, "max_position_embeddings": c.max_context}


def _inkling_model(c: ModelConfig, dtype: str) -> dict:
    """Inkling (``InklingForConditionalGeneration``, its text model): attention in every layer, sliding-window in the
    config's SWA layers (``local_layer_ids``), full in the rest, and short-conv states (``use_sconv``) in every layer
    (the config's state in its attention layers), the kernel of its kernel-major conv windows; dense, no MTP draft
    layers. SGLang sizes the windows itself (from the heads, head dim and hidden width): a config whose windows are
    not those is told apart by the pools' comparison."""
    text = {"model_type": "inkling_model", **_attention(c, dtype), "local_layer_ids": list(c.swa_layer_ids),
            "sliding_window_size": c.sliding_window, "use_sconv": True, "sconv_kernel_size": c.conv_shapes[0][0] + 1,
            "n_routed_experts": 0, "num_nextn_predict_layers": 0}
    return {"architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
            "text_config": text, "torch_dtype": dtype, "max_position_embeddings": c.max_context}


def _minimax_m3_model(c: ModelConfig, dtype: str) -> dict:
    """MiniMax-M3 sparse: each layer dense or sparse (``sparse_attention_freq``), a sparse layer's indexer keeping
    its value or not (``sparse_disable_index_value``), as the config's ``msa_layers`` letters say (D, V, K)."""
    letters = c.msa_layers
    return {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m2", **_attention(c, dtype),
            "sparse_attention_config": {"sparse_attention_freq": [0 if x == "D" else 1 for x in letters],
                                        "sparse_disable_index_value": [1 if x == "K" else 0 for x in letters],
                                        "sparse_index_dim": c.index_head_dim},
            "num_local_experts": 1, "num_experts_per_tok": 1}


def _qwen3_next_layers(c: ModelConfig) -> str | None:
    """Why no Qwen3-Next has ``c``'s layers, or None: MHA attention layers, one in every ``full_attention_interval``,
    the rest gated delta-net; no sliding window."""
    n, interval = c.num_layers, c.num_layers // max(c.full_layers, 1)
    if c.has_swa:
        return "a Qwen3-Next has no sliding-window layers"
    if c.attention != "mha":
        return f"a Qwen3-Next's attention layers are MHA, not {c.attention}"
    if n // interval != c.full_layers:
        return (f"a Qwen3-Next keeps one full-attention layer in every {interval}: {c.full_layers} among {n} layers "
                "is no Qwen3-Next's")
    return None


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    """A model that stands for a config's architecture: its ``config.json``, and the attention backend its GPU server
    names (one SGLang accepts for the model with every KV dtype its configs ask: a server left to choose picks by GPU,
    and some picks refuse FP4 or move the page size)."""

    config_json: Callable[[ModelConfig, str], dict]
    attention_backend: str
    # the server names its KV dtype where it is the model's: left to "auto", DeepSeek DSA's hook stores the KV as
    # fp8_e4m3 on a Hopper or Blackwell GPU
    names_model_kv_dtype: bool = False
    # the model class's window hook (a compat need), which the model runner asks before the model config's window
    window_hook: str | None = None
    # why no such model has a config's layers (a drawn mix its config.json cannot name), or None: no model stands for it
    layers_problem: Callable[[ModelConfig], str | None] = lambda c: None


# A config's architecture -> the model that stands for it. An architecture without an entry has no server: its configs
# are declined, saying so.
MODELS: dict[str, ModelKind] = {
    "llama": ModelKind(config_json=_dense_model, attention_backend="triton"),
    "gpt-oss": ModelKind(config_json=_gpt_oss_model, attention_backend="triton", window_hook="gpt_oss_window"),
    "qwen3-next": ModelKind(config_json=_qwen3_next_model, attention_backend="triton", layers_problem=_qwen3_next_layers),
    "deepseek-v3": ModelKind(config_json=_deepseek_v3_model, attention_backend="flashinfer"),
    "deepseek-v3.2": ModelKind(config_json=_deepseek_v32_model, attention_backend="flashinfer",
                               names_model_kv_dtype=True),
    "minimax-m3": ModelKind(config_json=_minimax_m3_model, attention_backend="triton"),
    "kimi-linear": ModelKind(config_json=_kimi_linear_model, attention_backend="flashinfer"),
    "glm5-next": ModelKind(config_json=_glm5_next_model, attention_backend="flashinfer", names_model_kv_dtype=True),
    "inkling": ModelKind(config_json=_inkling_model, attention_backend="triton"),
}


def model_shaped(c: ModelConfig) -> ModelConfig:
    """A drawn config as the model that stands for its kind of layers has them, so that a drawn example runs a server
    SGLang starts (a factory's ``model_shaped``): its rotary width even (an MHA head dim, a latent rope width),
    sliding-window beside recurrent layers as an Inkling keeps them (the only such model SGLang serves), recurrent
    beside full-attention MHA layers as a Qwen3-Next lays them out (``_as_qwen3_next``), beside MLA ones as a
    Kimi-Linear (``_as_kimi_linear``), beside DSA ones as a GLM-5 Next (Kimi-Linear's KDA layers, NoPE DSA ones),
    latent, sparse or MiniMax attention alone as the model of that attention. Any other config, or one whose reshaping no
    config can hold (a scale block that no longer divides the head dim, a conv of fewer than 12 values), as drawn:
    what no model has is then declined, with the reason."""
    try:
        shaped = c.replace(head_dim=c.head_dim + 1) if c.attention == "mha" and c.head_dim % 2 else c
        if shaped.latent and shaped.qk_rope_head_dim % 2:
            shaped = shaped.replace(qk_rope_head_dim=shaped.qk_rope_head_dim + 1)
        if shaped.has_swa and shaped.has_mamba:  # drawn so, or in layers of their own; its convs as wide as its heads
            return shaped.with_state_in_attention()
        if shaped.has_mamba and shaped.attention == "mla":
            return _as_kimi_linear(shaped)
        if shaped.has_mamba and shaped.attention == "dsa":
            # GLM-5 Next keeps Kimi-Linear's KDA layers, and its DSA layers no rope part (NoPE)
            return _as_kimi_linear(shaped).replace(architecture="glm5-next", qk_rope_head_dim=0)
        if shaped.has_mamba and shaped.attention == "mha" and shaped.has_full:
            return _as_qwen3_next(shaped)
        if not shaped.has_mamba and shaped.attention in _LATENT_MODELS:  # the model of its kind of attention
            return shaped.replace(architecture=_LATENT_MODELS[shaped.attention])
        return shaped
    except ConfigError:
        return c


# Full-attention models of each kind of attention but MHA (a drawn config's architecture names its layers only).
_LATENT_MODELS = {"mla": "deepseek-v3", "dsa": "deepseek-v3.2", "msa": "minimax-m3"}


def _as_kimi_linear(c: ModelConfig) -> ModelConfig:
    """``c`` as a Kimi-Linear (``_kimi_linear_model``): MLA layers between KDA ones, in any order; the KDA state heads
    x head dim x head dim in float32 (the KDA state SGLang keeps whatever the model's dtype), its conv state one
    kernel-major tensor over the query, key and value widths side by side, of the drawn kernel."""
    heads, head_dim, _ = c.temporal_shape
    return c.replace(architecture="kimi-linear", temporal_shape=(heads, head_dim, head_dim), state_dtype="float32",
                     conv_shapes=((c.conv_shapes[0][1], 3 * heads * head_dim),))


def _as_qwen3_next(c: ModelConfig) -> ModelConfig:
    """``c`` laid out as a Qwen3-Next (``_qwen3_next_model``): a full-attention layer last in every interval of at
    least two layers (as many intervals as full layers, the recurrent layers filling the rest), its head dim a
    multiple of 8 (a quarter of it is rotary, in pairs), and one conv state as wide as the query, key and value rows
    its temporal state implies (one key head), of the drawn kernel."""
    interval = max(2, c.num_layers // c.full_layers)
    heads, head_dim, key_dim = c.temporal_shape
    return c.replace(mamba_layers=c.full_layers * (interval - 1),
                     layer_pattern=("M" * (interval - 1) + "F") * c.full_layers, head_dim=-(-c.head_dim // 8) * 8,
                     conv_shapes=((2 * key_dim + heads * head_dim, c.conv_shapes[0][1]),))


def hf_model_config(config: ModelConfig):
    """The model's HF config as far as SGLang's resolution reads it: a real ``transformers`` config of a family with
    the config's kind of layers (a Nemotron-H model, attention and mamba layers, where it keeps recurrent state, so
    ``uses_ssm_state`` answers yes; a Llama model otherwise)."""
    if config.has_mamba:
        from sglang.srt.configs import NemotronHConfig

        return NemotronHConfig(architectures=["NemotronHForCausalLM"])
    from transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLM"])
