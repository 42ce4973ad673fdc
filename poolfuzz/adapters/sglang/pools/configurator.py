"""A config as the server it stands for (server flags and a model's ``config.json``), and the pools SGLang's own KV
cache configurator builds for that server on this machine.

What runs is SGLang's: ``ServerArgs`` with the flags and the model directory (its own validation), ``publish`` as a
scheduler process publishes, its parallel groups built by ``bootstrap._init_parallel_groups`` on one gloo rank, its
``ModelConfig`` read from the directory, the model runner's own leaves for the configurator's inputs
(``resolve_layer_indices``, ``configure_kv_cache_dtype``, ``resolve_sliding_window_size``), and
``KVCacheConfigurator.configure``, which sizes the pools from the memory it finds and the flags' caps
(``--max-total-tokens``, ``--max-running-requests``, ``--swa-full-tokens-ratio``, ``--max-mamba-cache-size``), then
builds the request pool, the KV pool and the allocator.

Stood in for: the model, which a configurator reads only for its quantisation and layer hooks: an object with no
weights and none of those hooks (so SGLang takes its defaults from the model config); the free GPU memory the
configurator's budget starts from (``get_available_gpu_memory`` in ``_profile_available_bytes``, after a
``gc.collect`` of 0.3 s a build), answered with a fixed ``MEMORY_BUDGET`` so the flags' caps decide every size, the
same on every machine, while the rest of that method (its mamba budget) is SGLang's; and the GPU a server runs on
(``compat.platform``: a B200 for every config but the CPU server's), so that the flags are resolved and the pools
built as that GPU's server resolves and builds them (without CUDA, SGLang's base platform refuses FP4 KV, ``mxfp8``
and the mamba extra buffer, and DSA's model hook asks the GPU's compute capability); and, for a speculative server
(``--speculative-algorithm NEXTN``: the target worker's pools, with a state row per draft token), the one launch of
SGLang's tiled KV copy kernel its pools make when built, over dummy locations (it moves nothing; a real move called
then is refused): the pools move rows with SGLang's native torch move (``SGLANG_NATIVE_MOVE_KV_CACHE``). The draft
worker's own pools (a second KV pool over the same allocator) are not built.

One registry (``MODELS``) maps a config's architecture to the model that stands for it; one with no entry yet is
named as such, never built another way. Releases before 0.5.16 have no configurator (their model runner builds
the pools); 0.5.16 to 0.5.21 publish a scheduler's ranks otherwise, and are not driven here yet.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import tempfile
import traceback
import types
import warnings
from unittest import mock
from dataclasses import dataclass, field
from typing import Callable

from poolfuzz.adapters.sglang.compat import has_private, private, private_module, private_name
from poolfuzz.adapters.sglang.compat.platform import B200, GPU, gpu_server, platform_problem
from poolfuzz.adapters.sglang.pools.calls import native_kv_move
from poolfuzz.errors import ConfigError
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.quantised import MODEL_DTYPE

# What the GPU memory probe answers: more than any config's pools take, so the flags' caps bind.
MEMORY_BUDGET = 1 << 30
# The KV dtype flag for each config dtype: a float dtype is the model's own (``--kv-cache-dtype auto``).
_MODEL_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class ServerModel:
    """The server a config stands for: its flags (``ServerArgs`` fields) and its model's ``config.json``."""

    kind: str  # the config's architecture
    flags: dict
    hf_config: dict
    gpu: GPU | None = None  # the GPU it runs on (stood in for while its pools are built); None: a CPU server

    def command_line(self) -> str:
        """The flags as ``python -m sglang.launch_server`` takes them (the model path left out)."""
        return command_line(self.flags)


def command_line(flags: dict) -> str:
    """Server flags as ``python -m sglang.launch_server`` takes them."""
    out = []
    for name, value in sorted(flags.items()):
        flag = "--" + name.replace("_", "-")
        out.append(flag if value is True else f"{flag} {value}")
    return " ".join(out)


@dataclass(frozen=True, kw_only=True)
class ConfiguredPools:
    """What SGLang's configurator built for a server: the three pools, and what it sized them to."""

    server: ServerModel
    req_to_token_pool: object
    token_to_kv_pool: object
    allocator: object
    sizes: dict = field(default_factory=dict)
    unified_buffer: object = None  # --enable-unified-memory: the byte buffer the sub-pools share

    def parts(self) -> dict[str, str]:
        """Each pool (and each part of a hybrid one) with its class and size, in a listing's words."""
        return describe_pools(self.req_to_token_pool, self.token_to_kv_pool, self.allocator)


def describe_pools(req_to_token_pool, token_to_kv_pool, allocator) -> dict[str, str]:
    """Each pool and each part of a hybrid one: its class, size, and the shapes and layers that tell two builds apart
    (the configurator's and the family's alike)."""
    rows = getattr(req_to_token_pool, "req_to_token", None)
    out = {"request pool": type(req_to_token_pool).__name__ + (f" ({rows.shape[0]} rows of {rows.shape[1]} tokens)"
                                                                if rows is not None else "")}
    mamba = getattr(req_to_token_pool, "mamba_pool", None)
    if mamba is not None:
        cache = mamba.mamba_cache
        conv = ", ".join(str(tuple(t.shape[2:])) for t in cache.conv)
        spec = getattr(cache, "intermediate_ssm", None)  # a speculative server's per-draft-token states
        out["mamba pool"] = (f"{type(mamba).__name__} ({mamba.size} slots; conv {conv}; "
                             f"temporal {tuple(cache.temporal.shape[2:])} {cache.temporal.dtype}"
                             + (f"; {spec.shape[2]} draft-token states for {spec.shape[1]} requests"
                                if spec is not None else "") + ")")
    quant = type(getattr(token_to_kv_pool, "quant_method", None)).__name__
    layers = ""
    mapping = getattr(token_to_kv_pool, "layers_mapping", None)
    if isinstance(mapping, dict) and mapping:
        layers = "; sliding-window layers " + str(sorted(i for i, (_, swa) in mapping.items() if swa))
    full_ids = getattr(token_to_kv_pool, "full_attention_layer_id_mapping", None)  # a hybrid linear pool's
    if not layers and isinstance(full_ids, dict):
        layers = f"; attention layers {sorted(full_ids)}"
    out["KV pool"] = (f"{type(token_to_kv_pool).__name__} ({token_to_kv_pool.size} tokens, "
                      f"{getattr(token_to_kv_pool, 'dtype', '?')}"
                      + (f", {quant}" if quant not in ("NoneType", "UnquantizedKVCacheMethod") else "") + layers + ")")
    for part in ("full_kv_pool", "swa_kv_pool", "main_pool", "index_kv_pool", "index_k_pool"):
        sub = getattr(token_to_kv_pool, part, None)
        if sub is not None:
            out[part.replace("_", " ")] = f"{type(sub).__name__} ({sub.size} tokens, {getattr(sub, 'dtype', '?')})"
    out["allocator"] = f"{type(allocator).__name__} ({allocator.size} tokens)"
    return out


def same_pools(built: dict[str, str], family: dict[str, str]) -> bool:
    """Whether two descriptions name the same pools, the request rows' width aside (SGLang adds columns past the
    context that no request of the config reaches)."""
    def rows_only(d):
        return {k: (v.split(" of ")[0] if k == "request pool" else v) for k, v in d.items()}
    return rows_only(built) == rows_only(family)


_SIZE = re.compile(r"\b\d+ (tokens|slots|rows)\b")


def same_layout(built: dict[str, str], family: dict[str, str]) -> bool:
    """Whether two descriptions name the same pool classes, shapes, dtypes and layers, whatever their sizes: a unified
    memory pool's sub-pools are sized by SGLang from one byte envelope, and what fits is the engine's own answer."""
    def shapes_only(d):
        return {k: _SIZE.sub(r"N \1", v) for k, v in d.items()}
    return shapes_only(built) == shapes_only(family)


def _layer_count(c: ModelConfig) -> int:
    return c.full_layers + c.swa_layers + c.mamba_layers


def _dtype_flags(c: ModelConfig) -> tuple[str, dict]:
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
    return {"num_hidden_layers": _layer_count(c), "num_attention_heads": c.head_num,
            "num_key_value_heads": c.head_num, "head_dim": c.head_dim, "hidden_size": c.head_num * c.head_dim,
            "intermediate_size": 4 * c.head_num * c.head_dim, "vocab_size": 256,
            "max_position_embeddings": c.max_context, "torch_dtype": dtype,
            # token ids inside the small vocabulary (a model's defaults name ids past it, and transformers warns)
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _dense_model(c: ModelConfig, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_attention(c, dtype)}


def _gpt_oss_model(c: ModelConfig, dtype: str) -> dict:
    """GPT-OSS: sliding-window and full-attention layers as its ``layer_types`` name them (SGLang's
    ``get_hybrid_layer_ids`` reads them), with one expert per layer."""
    layer_types = ["sliding_attention" if i in c.swa_layer_ids else "full_attention" for i in range(_layer_count(c))]
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **_attention(c, dtype),
            "sliding_window": c.sliding_window, "layer_types": layer_types, "num_local_experts": 1,
            "num_experts_per_tok": 1}


def _qwen3_next_model(c: ModelConfig, dtype: str) -> dict:
    """Qwen3-Next: gated delta-net layers with a full-attention layer every ``full_attention_interval`` (the last of
    each interval, so the config's count of each is kept, not its order); the recurrent state is heads x head_dim x
    key head_dim, its conv rows the query, key and value widths together."""
    heads, head_dim, key_dim = c.temporal_shape
    interval = _layer_count(c) // max(c.full_layers, 1)
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
            "qk_nope_head_dim": c.head_dim, "v_head_dim": c.head_dim, "first_k_dense_replace": _layer_count(c),
            "n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 16, "rope_scaling": None}


def _deepseek_v32_model(c: ModelConfig, dtype: str) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3 with its sparse attention's indexer (``index_topk``, the config's index width),
    which SGLang's ``is_deepseek_dsa`` asks for."""
    return {**_deepseek_v3_model(c, dtype), "index_topk": 4, "index_head_dim": c.index_head_dim, "index_n_heads": 1}


def _kimi_linear_model(c: ModelConfig, dtype: str) -> dict:
    """Kimi-Linear: MLA layers between KDA (recurrent) ones, as its ``linear_attn_config`` names them (layers counted
    from 1); the KDA state is heads x head_dim x head_dim, with a short conv per q, k and v."""
    heads, head_dim, _ = c.temporal_shape
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_attention(c, dtype),
            "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": None, "qk_rope_head_dim": c.qk_rope_head_dim,
            "qk_nope_head_dim": c.head_dim, "v_head_dim": c.head_dim, "num_experts": None,
            "linear_attn_config": {"kda_layers": [i + 1 for i in c.mamba_layer_ids],
                                   "full_attn_layers": [i + 1 for i in c.full_layer_ids], "num_heads": heads,
                                   "head_dim": head_dim, "short_conv_kernel_size": c.conv_shapes[0][1] + 1}}


def _inkling_model(c: ModelConfig, dtype: str) -> dict:
    """Inkling (``InklingForConditionalGeneration``, its text model): attention in every layer, sliding-window in the
    config's SWA layers (``local_layer_ids``), full in the rest, and short-conv states (``use_sconv``) in every layer,
    the config's kernel; dense, no MTP draft layers. The config's separate recurrent layers are no Inkling's."""
    text = {"model_type": "inkling_model", **_attention(c, dtype), "local_layer_ids": list(c.swa_layer_ids),
            "sliding_window_size": c.sliding_window, "use_sconv": True, "sconv_kernel_size": c.conv_shapes[0][1] + 1,
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


# A config's architecture -> the model that stands for it. Architectures without an entry (Inkling) are not built
# through the configurator yet.
MODELS: dict[str, ModelKind] = {
    "llama": ModelKind(config_json=_dense_model, attention_backend="triton"),
    "gpt-oss": ModelKind(config_json=_gpt_oss_model, attention_backend="triton"),
    "qwen3-next": ModelKind(config_json=_qwen3_next_model, attention_backend="triton"),
    "deepseek-v3": ModelKind(config_json=_deepseek_v3_model, attention_backend="flashinfer"),
    "deepseek-v3.2": ModelKind(config_json=_deepseek_v32_model, attention_backend="flashinfer",
                               names_model_kv_dtype=True),
    "minimax-m3": ModelKind(config_json=_minimax_m3_model, attention_backend="triton"),
    "kimi-linear": ModelKind(config_json=_kimi_linear_model, attention_backend="flashinfer"),
    "inkling": ModelKind(config_json=_inkling_model, attention_backend="triton"),
}


def server_gpu(c: ModelConfig) -> GPU | None:
    """The GPU ``c``'s server runs on, or None for a CPU server (SGLang's CPU FP8 KV cache is a CPU server's)."""
    return None if c.kv_quant == "cpu_fp8_e4m3" else B200


def server_flags(c: ModelConfig) -> dict:
    """The flags of the server ``c`` stands for (``ServerArgs`` fields), whether or not a model stands for it yet."""
    model_dtype, flags = _dtype_flags(c)
    if not flags and c.architecture in MODELS and MODELS[c.architecture].names_model_kv_dtype:
        flags["kv_cache_dtype"] = model_dtype
    if server_gpu(c) is None:
        flags["device"] = "cpu"
    elif c.architecture in MODELS:
        flags["attention_backend"] = MODELS[c.architecture].attention_backend
    flags.update(page_size=c.page_size, max_total_tokens=c.full_tokens or c.swa_tokens,
                 max_running_requests=c.request_rows)
    if c.has_swa and c.has_full:
        flags["swa_full_tokens_ratio"] = c.swa_tokens / c.full_tokens
    if c.has_mamba:
        flags.update(max_mamba_cache_size=c.mamba_slots, disable_overlap_schedule=True,
                     mamba_radix_cache_strategy="extra_buffer" if c.mamba_track_slots else "no_buffer")
    if c.spec_draft_tokens:
        # the model's own MTP layers draft (NEXTN, which SGLang runs as EAGLE), a tree of top-k 2 verified in one
        # forward of the config's draft tokens: the target's pools keep one state row per draft token
        flags.update(speculative_algorithm="NEXTN", speculative_num_draft_tokens=c.spec_draft_tokens,
                     speculative_num_steps=c.spec_draft_tokens - 1, speculative_eagle_topk=2)
    return flags


def server_model(c: ModelConfig) -> ServerModel:
    """The server ``c`` stands for; a ConfigError naming what is missing where no model stands for it yet."""
    kind = c.architecture
    if kind not in MODELS:
        raise ConfigError(f"config {c.name!r}: no model stands for architecture {kind!r} on the configurator path "
                          f"yet (it has models for: {', '.join(MODELS)})")
    return ServerModel(kind=kind, flags=server_flags(c), hf_config=MODELS[kind].config_json(c, _dtype_flags(c)[0]),
                       gpu=server_gpu(c))


_REFUSALS: dict[ModelConfig, str | None] = {}


def refusal(c: ModelConfig) -> str | None:
    """SGLang's words where its own validation refuses ``c``'s server (no such server starts), else None: also None
    where the configurator cannot tell (this release has none, no model stands for the config yet, or this machine
    cannot build the server's pools). Asked once per config per process."""
    if c not in _REFUSALS:
        try:
            configure(c)
            _REFUSALS[c] = None
        except ServerRefused as exc:
            _REFUSALS[c] = exc.reason
        except ConfigError:
            _REFUSALS[c] = None
    return _REFUSALS[c]


def problem() -> str | None:
    """Why this release cannot build pools through its configurator here, or None."""
    missing = [k for k in ("kv_cache_configurator", "configurator_free_memory", "configurator_gc", "spawn_ranks", "init_parallel_groups",
                           "post_capture_kv_active", "resolve_layer_indices", "configure_kv_cache_dtype",
                           "resolve_sliding_window_size", "spec_aux_config")
               if not has_private(k)]
    if not missing:
        return None
    if "kv_cache_configurator" in missing:
        return "this release has no KV cache configurator (0.5.16 on): its model runner builds the pools"
    return (f"the configurator path drives SGLang 0.5.22 on, and this release lacks {', '.join(missing)} (before "
            "0.5.22 a scheduler process publishes its ranks otherwise)")


def configure(c: ModelConfig, *, device: str = "cpu", role_flags: dict | None = None) -> ConfiguredPools:
    """Build ``c``'s server's pools with SGLang's configurator; a ConfigError with SGLang's words where the server (or
    this release, or this machine's platform) refuses it. ``role_flags``: the flags that make the server what it is
    beside its model and sizes (a PD decode server's ``--disaggregation-mode decode``, ...); what SGLang's hooks
    resolve from them (the decode side's extra request rows, its disabled radix cache) is theirs."""
    reason = problem()
    if reason:
        raise ConfigError(f"config {c.name!r}: {reason}")
    server = server_model(c)
    if role_flags:
        server = dataclasses.replace(server, flags=server.flags | role_flags)
    if server.gpu is not None and platform_problem():
        raise ConfigError(f"config {c.name!r}: its server runs on a GPU, which cannot be stood in for on this "
                          f"release ({platform_problem()})")
    model_dir = _model_dir(server.hf_config)
    from poolfuzz.adapters.sglang.server_args import another_server

    try:
        with another_server(), _sglang_quiet():  # the caller's server published again once these pools are built
            result = _configured(server, model_dir, device)
    except _Refused as refused:
        exc = refused.__cause__
        reason = (f"SGLang refuses the server {server.command_line()!r}: "
                  f"{type(exc).__name__}: {_first_line(exc)}")
        raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason) from None
    except Exception as exc:  # noqa: BLE001 -- whatever SGLang (or transformers, parsing the model) refuses it with
        raise ConfigError(f"config {c.name!r}: SGLang cannot build the server {server.command_line()!r} here: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    sizes = {"max_total_num_tokens": result.max_total_num_tokens,
             "max_running_requests": result.max_running_requests,
             "full_max_total_num_tokens": result.full_max_total_num_tokens,
             "swa_max_total_num_tokens": result.swa_max_total_num_tokens}
    return ConfiguredPools(server=server, req_to_token_pool=result.req_to_token_pool,
                           token_to_kv_pool=result.token_to_kv_pool, allocator=result.token_to_kv_pool_allocator,
                           sizes=sizes, unified_buffer=getattr(result, "unified_memory_pool", None))


@contextlib.contextmanager
def _sglang_quiet():
    """SGLang's warnings held back while a server is resolved (a CPU machine's fallbacks, printed at every build of
    every example, and warnings of its imports, which a warnings filter set to raise would turn into refusals); what
    refuses the server is raised, and reported."""
    logger = logging.getLogger("sglang")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


class ServerRefused(ConfigError):
    """SGLang's own validation of the server's flags refuses them: no such server starts, so nothing is fuzzed.
    ``reason``: SGLang's words, without the config's name."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (a campaign's workers) with its reason
        return type(self), (self.args[0],), {"reason": self.reason}


class _Refused(Exception):
    """Raised from the flags' resolution by SGLang's own code (its cause is SGLang's error)."""


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _raised_by_sglang(exc: BaseException) -> bool:
    """Whether SGLang's own code raised ``exc`` (not torch, asked for a device this machine lacks)."""
    import sglang

    frames = traceback.extract_tb(exc.__traceback__)
    package = os.path.dirname(os.path.abspath(sglang.__file__)) + os.sep
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package)


def _on_server_machine(server: ServerModel):
    """The server's machine as SGLang sees it: its GPU stood in for (``compat.platform``), or this CPU."""
    return gpu_server(server.gpu) if server.gpu is not None else contextlib.nullcontext()


def _configured(server: ServerModel, model_dir: str, device: str):
    """SGLang's configurator run for ``server`` (published as a scheduler process publishes it), its result. The
    server's flags are resolved and its pools built as on its machine; its one-rank parallel groups are a CPU
    process's (gloo), built outside the GPU's stand-in. ``ServerArgs`` keeps ``device="cpu"`` for a GPU server too,
    so that no hook sizes anything from this machine's devices; the flags name what a GPU server would otherwise pick
    by device (its attention backend)."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    with _on_server_machine(server):
        try:
            args = ServerArgs(model_path=model_dir, **({"device": "cpu"} | server.flags))
            publish(args, role="scheduler", ranks=private("spawn_ranks")(world_rank=0, dp_rank=None, gpu_id=0))
        except Exception as exc:  # noqa: BLE001 -- SGLang's validation raises many types
            if _raised_by_sglang(exc):
                raise _Refused() from exc
            raise
    _parallel_groups(args)
    with _on_server_machine(server):
        return _built(args, model_dir, device)


def _built(args, model_dir: str, device: str):
    """The configurator's result for the published ``args`` (the model runner's leaves give its inputs)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    model_config = SGLangModelConfig(model_path=model_dir)
    model = types.SimpleNamespace()  # no weights, no quantisation, no layer hooks: the model config decides
    # the target worker's (this server's pools are its; a draft worker builds its own beside them, not here)
    spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    kv_name, kv_dtype = private("configure_kv_cache_dtype")(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=model, model_dtype=model_config.dtype,
        is_draft_worker=False, is_dflash=False, speculative_draft_attention_backend=None,
        speculative_draft_kv_cache_dtype=None)
    # each argument as ModelRunner.init_kv_cache_configurator passes it, from what the runner holds: the published
    # server's page size (a model hook may have reset it), its groups, SGLang's own post-capture answer
    pp_group = get_parallel().pp_group
    configurator = private("kv_cache_configurator")(
        device=device, gpu_id=0, attn_dp_size=get_parallel().attn_dp_size, pp_size=pp_group.world_size,
        pp_group=pp_group, model=model, model_config=model_config, server_args=args, kv_cache_dtype=kv_dtype,
        kv_cache_dtype_str=kv_name if kv_name is not None else get_model().kv_cache_dtype,
        model_dtype=model_config.dtype, page_size=get_schedule().page_size,
        sliding_window_size=private("resolve_sliding_window_size")(model, model_config),
        spec_algorithm=spec_algorithm, is_draft_worker=False,
        post_capture_kv_active=private("post_capture_kv_active")(
            server_args=args, is_draft_worker=False, spec_algorithm=spec_algorithm,
            token_to_kv_pool_allocator=None),
        spec_aux_config=private("spec_aux_config")(server_args=args, model_config=model_config,
                                                   spec_algorithm=spec_algorithm, is_draft_worker=False),
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=private("resolve_layer_indices")(model=model, model_config=model_config,
                                                    is_draft_worker=False),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None)
    with _fixed_free_memory(), _kv_copy_warmup_skipped(), native_kv_move():
        return configurator.configure(pre_model_load_memory=0)


@contextlib.contextmanager
def _kv_copy_warmup_skipped():
    """A speculative server's pools (``enable_kv_cache_copy``) launch SGLang's tiled KV copy kernel once when built,
    copying dummy location 0 onto itself in every layer to warm the kernel up: a Triton launch (a GPU's), which moves
    nothing, stood in for by nothing. Any other call (a real move) is refused, not skipped: the pools' moves take
    SGLang's native torch path (``native_kv_move``, read when a pool is built)."""
    if not has_private("kv_copy_kernel"):
        yield
        return
    module = private_module("kv_copy_kernel")

    def warmup(data_ptrs, data_strides, tgt_loc, src_loc, *args, **kwargs):
        if bool(tgt_loc.any()) or bool(src_loc.any()):
            raise RuntimeError("the tiled KV copy kernel was called for a real move while pools were being built")

    with mock.patch.object(module, private_name("kv_copy_kernel"), warmup):
        yield


@contextlib.contextmanager
def _fixed_free_memory():
    """The configurator's free-memory probe answered with ``MEMORY_BUDGET`` (and its ``gc.collect`` before it
    skipped) for the span of one build: the rest of ``_profile_available_bytes`` is SGLang's, its mamba budget among it
    (``_handle_max_mamba_cache``: the mamba slots a server gets, from ``--max-mamba-cache-size``, its running requests
    or its memory)."""
    module = private_module("configurator_free_memory")
    budget_gb = MEMORY_BUDGET / (1 << 30)
    with mock.patch.object(module, private_name("configurator_free_memory"), lambda *a, **k: budget_gb), \
            mock.patch.object(module, private_name("configurator_gc"), types.SimpleNamespace(collect=lambda: 0)):
        yield


_GROUPS: dict[str, object] = {}


def _parallel_groups(args) -> None:
    """SGLang's own parallel groups of a one-rank server, built once per process (gloo: no GPU), their file store in
    a temporary directory removed when the process ends."""
    if "store" in _GROUPS:
        return
    _GROUPS["store"] = store = _kept_temporary("groups")
    private("init_parallel_groups")(backend="gloo", dist_init_method=f"file://{store.name}/store", server_args=args,
                                    gpu_id=0)


_MODEL_DIRS: dict[str, str] = {}
_TEMPORARY: dict[str, tempfile.TemporaryDirectory] = {}


def _kept_temporary(what: str) -> tempfile.TemporaryDirectory:
    """A temporary directory for ``what``, made once per process and removed when it exits."""
    if what not in _TEMPORARY:
        _TEMPORARY[what] = tempfile.TemporaryDirectory(prefix=f"poolfuzz-{what}-")
        atexit.register(_TEMPORARY[what].cleanup)
    return _TEMPORARY[what]


def _model_dir(hf_config: dict) -> str:
    """A directory holding the model's ``config.json`` (no weights: the configurator reads none), one per model per
    process (a family is built for every example), under one temporary directory removed when the process ends."""
    text = json.dumps(hf_config, indent=1, sort_keys=True)
    if text not in _MODEL_DIRS:
        path = os.path.join(_kept_temporary("models").name, str(len(_MODEL_DIRS)))
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as fh:
            fh.write(text)
        _MODEL_DIRS[text] = path
    return _MODEL_DIRS[text]
