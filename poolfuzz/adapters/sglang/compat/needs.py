"""What the sglang families need of the installed SGLang, listed once: where each class lives across
releases, which are needed and which are features the adapter probes and does without.

``api.load`` resolves every :class:`~poolfuzz.adapters.engine_api.Need` here into an ``SGLangAPI``; a
needed one that the installed release lacks is an ``EngineApiChanged`` (verdict "API CHANGED", exit 2,
no artifact), never a finding. ``poolfuzz doctor --family sglang`` prints the same probes.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache

from poolfuzz.adapters.engine_api import PRESENT, EngineReport, Need, Probe, probe, report
from poolfuzz.errors import EngineApiChanged

ENGINE = "sglang"
_MP = "sglang.srt.mem_cache.memory_pool"
_ALLOC = "sglang.srt.mem_cache.allocator"
_SB = "sglang.srt.managers.schedule_batch"

# SGLangAPI's fields, each resolved from its need (the first place that imports, releases moved them).
NEEDS: dict[str, Need] = {
    "ReqToTokenPool": Need(target=f"{_MP}:ReqToTokenPool", used_for="request rows"),
    "HybridReqToTokenPool": Need(target=f"{_MP}:HybridReqToTokenPool", used_for="request rows of a hybrid model"),
    "MambaPool": Need(target=f"{_MP}:MambaPool", used_for="recurrent state"),
    "MHATokenToKVPool": Need(target=f"{_MP}:MHATokenToKVPool", used_for="K and V rows"),
    "HybridLinearKVPool": Need(target=f"{_MP}:HybridLinearKVPool", used_for="hybrid linear-attention models"),
    "SWAKVPool": Need(target="sglang.srt.mem_cache.swa_memory_pool:SWAKVPool", also=(f"{_MP}:SWAKVPool",),
                      used_for="sliding-window models"),
    "TokenToKVPoolAllocator": Need(target=f"{_ALLOC}.token:TokenToKVPoolAllocator",
                                   also=(f"{_ALLOC}:TokenToKVPoolAllocator",), used_for="token slots"),
    "PagedTokenToKVPoolAllocator": Need(target=f"{_ALLOC}.paged:PagedTokenToKVPoolAllocator",
                                        also=(f"{_ALLOC}:PagedTokenToKVPoolAllocator",), used_for="paged configs"),
    "SWATokenToKVPoolAllocator": Need(target=f"{_ALLOC}.swa:SWATokenToKVPoolAllocator",
                                      also=("sglang.srt.mem_cache.swa_memory_pool:SWATokenToKVPoolAllocator",
                                            f"{_ALLOC}:SWATokenToKVPoolAllocator"), used_for="SWA slots"),
    "MambaSlotAllocator": Need(target=f"{_ALLOC}.mamba:MambaSlotAllocator", required=False,
                               used_for="mamba slots apart from the pool (absent: the MambaPool allocates them)"),
    "Req": Need(target=f"{_SB}:Req", used_for="every request, and its retraction path"),
    "ReqKvInfo": Need(target=f"{_SB}:ReqKvInfo", required=False,
                      used_for="a request's KV fields on req.kv (absent: flat on the Req)"),
    "MLATokenToKVPool": Need(target=f"{_MP}:MLATokenToKVPool", required=False, used_for="MLA configs"),
    "DSATokenToKVPool": Need(target=f"{_MP}:DSATokenToKVPool", also=(f"{_MP}:NSATokenToKVPool",), required=False,
                             used_for="DSA configs"),
    "MHATokenToKVPoolMXFP8": Need(target=f"{_MP}:MHATokenToKVPoolMXFP8", required=False,
                                  used_for="fp8-scaled configs"),
    "PureSWATokenToKVPoolAllocator": Need(target=f"{_ALLOC}.swa:PureSWATokenToKVPoolAllocator", required=False,
                                          used_for="all-SWA models"),
    "get_parallel": Need(target="sglang.srt.runtime_context:get_parallel", required=False,
                         used_for="the runtime's parallel context, where pools read it"),
}


def release() -> str:
    from importlib.metadata import version

    return version("sglang")


def engine_report() -> EngineReport:
    """Every need probed (``poolfuzz doctor``), once SGLang is imported behind the CPU shims (``api.load``)."""
    return report(engine_report_needs(), engine=ENGINE, release=release())


# --- SGLang's private names ------------------------------------------------------------------------------
# The few things the adapter must take from SGLang that SGLang keeps private (no public name gives them in
# 0.5.23): each is read here and nowhere else, checked, and an EngineApiChanged when a release drops it. The
# doctor lists the class-level ones (optional: the paths that use them check for them first).
_UNIFIED = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker:SchedulerInvariantChecker"
_MAMBA_BACKEND = "sglang.srt.layers.attention.hybrid_linear_attn_backend:MambaAttnBackendBase"
PRIVATE: dict[str, Need] = {
    "check_all_pools": Need(target=f"{_CHECKER}._check_all_pools", required=False,
                            used_for="private: the scheduler's idle leak check"),
    "check_req_pool": Need(target=f"{_CHECKER}._check_req_pool", required=False,
                           used_for="private: the scheduler's idle request-row leak check"),
    "cuda_host_register": Need(target="sglang.srt.mem_cache.pool_host.common:_cuda_host_register", required=False,
                               used_for="private: replaced by a no-op on a machine without CUDA"),
    "inline_host_register": Need(target="sglang.srt.mem_cache.memory_pool_host:alloc_with_host_register",
                                 required=False, used_for="private: 0.5.12's host pools call the CUDA runtime inline "
                                 "(a CPU runtime stand-in answers them on a machine without CUDA)"),
    "cuda_host_ranges_attr": Need(target="sglang.srt.mem_cache.pool_host.common:_CUDA_HOST_REGISTERED_RANGES_ATTR",
                                  required=False, used_for="private: what the no-op register records"),
    "retraction_device_transfers": Need(target=f"{_UNIFIED}._retraction_device_transfers", required=False,
                                        used_for="private: host-pool retraction, borrowed onto the stand-in tree"),
    "reclaim_retraction_host": Need(target=f"{_UNIFIED}._reclaim_retraction_host", required=False,
                                    used_for="private: host-pool retraction, borrowed onto the stand-in tree"),
    "build_sidecar_transfers": Need(target=f"{_UNIFIED}._build_sidecar_transfers", required=False,
                                    used_for="private: host-pool retraction, borrowed onto the stand-in tree"),
    "pad_retraction_indices": Need(target=f"{_UNIFIED}._pad_retraction_indices", required=False,
                                   used_for="private: host-pool retraction, borrowed onto the stand-in tree"),
    "storage_registry": Need(target="sglang.srt.mem_cache.storage.backend_factory:StorageBackendFactory._registry",
                             required=False, used_for="private: which L3 storage backends are registered"),
    "compute_max_prefix_len": Need(target=f"{_SB}:Req._compute_max_prefix_len", required=False,
                                   used_for="private: the span an L3 prefetch covers"),
    "kv_cache_configurator": Need(target="sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator",
                                  required=False, used_for="the pools a server builds from its flags (0.5.16 on)"),
    "runtime_publish": Need(target="sglang.srt.runtime_context:publish", required=False,
                            used_for="a scheduler process's publication of its server arguments (0.5.17 on; 0.5.16's "
                                     "model runner publishes them through set_global_server_args_for_scheduler)"),
    "spawn_ranks": Need(target="sglang.srt.runtime_context:SpawnRanks", required=False,
                        used_for="a scheduler process's ranks, published with its server arguments (0.5.22 on)"),
    "parallel_state": Need(target="sglang.srt.distributed.parallel_state_wrapper:ParallelState", required=False,
                           used_for="a model runner's ranks before 0.5.22 (its one-rank ParallelState.trivial), which "
                                    "its parallel groups and KV cache configurator take"),
    "configurator_free_memory": Need(target="sglang.srt.mem_cache.kv_cache_configurator:get_available_gpu_memory",
                                     required=False,
                                     used_for="private: the free GPU memory the configurator's budget starts from, "
                                              "stood in for by a fixed budget"),
    "configurator_platform": Need(target="sglang.srt.mem_cache.kv_cache_configurator:current_platform",
                                  required=False,
                                  used_for="private: the platform the configurator asks whether the server is a CPU "
                                           "one (its CPU FP8 KV cache), answered as SGLang's CPU engine for a CPU "
                                           "server"),
    "configurator_amx_probe": Need(target="sglang.srt.mem_cache.kv_cache_configurator:cpu_has_amx_support",
                                   required=False,
                                   used_for="private: the configurator's AMX probe, answered for a CPU server's Xeon"),
    "cpu_platform": Need(target="sglang.srt.platforms.cpu:CpuSRTPlatform", required=False,
                         used_for="the platform SGLang's CPU engine runs on (SGLANG_USE_CPU_ENGINE=1)"),
    "gpt_oss_window": Need(target="sglang.srt.models.gpt_oss:GptOssForCausalLM.get_attention_sliding_window_size",
                           required=False,
                           used_for="the window a GPT-OSS model serves (its checkpoint's sliding_window, HF's inclusive "
                                    "count, less one), which the model runner asks its model for"),
    "configurator_gc": Need(target="sglang.srt.mem_cache.kv_cache_configurator:gc", required=False,
                            used_for="private: the collection before the free-memory probe (0.3 s a build), which "
                                     "frees no GPU memory here"),
    "kv_copy_kernel": Need(target="sglang.srt.mem_cache.memory_pool:copy_all_layer_kv_cache_func", required=False,
                           used_for="private: the tiled KV row copy (a Triton kernel) a speculative server's pool "
                                    "launches once when built, over dummy locations, to warm it up"),
    "init_kv_cache_configurator": Need(target="sglang.srt.model_executor.model_runner:"
                                              "ModelRunner.init_kv_cache_configurator", required=False,
                                       used_for="the model runner's own construction of its KV cache configurator, "
                                                "run on a runner stand-in (0.5.16 on)"),
    "init_parallel_groups": Need(target="sglang.srt.distributed.bootstrap:_init_parallel_groups", required=False,
                                 used_for="private: a one-rank server's parallel groups, built on gloo"),
    "resolve_layer_indices": Need(target="sglang.srt.model_executor.model_runner_components.layer_setup:"
                                         "resolve_layer_indices", required=False,
                                  used_for="the model runner's layer split, for the configurator"),
    "adjust_hybrid_swa_layer_ids": Need(target="sglang.srt.model_executor.model_runner_components.layer_setup:"
                                               "adjust_hybrid_swa_layer_ids", required=False,
                                        used_for="the model runner's narrowing of a hybrid SWA model's layer ids to "
                                                 "its own layers, after its layer split (before 0.5.22)"),
    "resolve_sliding_window_size": Need(target="sglang.srt.model_executor.model_runner_components.load_model_utils:"
                                               "resolve_sliding_window_size", required=False,
                                        used_for="the model runner's sliding window, for the configurator"),
    "spec_aux_config": Need(target="sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state:"
                                   "resolve_spec_aux_hidden_state_config", required=False,
                            used_for="the model runner's speculative hidden-state record, resolved from the "
                                     "server's speculative flags (init_spec_aux_hidden_state)"),
    "override_platform": Need(target="sglang.srt.runtime_context:override_platform", required=False,
                              used_for="the machine's facts every server hook reads, stated for a GPU server "
                                       "(0.5.19 on)"),
    "platform_probes": Need(target="sglang.srt.runtime_context:_PLATFORM_PROBES", required=False,
                            used_for="private: the platform facts override_platform takes (a release refuses one "
                                     "it does not read: 0.5.19 to 0.5.21 have no is_mps, is_sm110)"),
    "platform_values": Need(target="sglang.srt.runtime_context:_PLATFORM_VALUES", required=False,
                            used_for="private: the valued platform facts override_platform takes"),
    "cuda_probe": Need(target="sglang.srt.utils.common:is_cuda", required=False,
                       used_for="private: SGLang's call-time CUDA probe (is_float4_e2m1fn_x2 asks it), answered "
                                "for a GPU server"),
    "gpu_memory_capacity": Need(target="sglang.srt.utils.common:get_nvgpu_memory_capacity", required=False,
                                used_for="private: the GPU's memory as the server's memory hook asks it, answered "
                                         "for a GPU server"),
    "calculate_mamba_ratio": Need(target="sglang.srt.mem_cache.kv_cache_configurator:"
                                         "KVCacheConfigurator._calculate_mamba_ratio", required=False,
                                  used_for="private: mamba slots per request where a tree caches state"),
    "deferred_mamba_cow_and_clear": Need(target="sglang.srt.model_executor.model_runner:"
                                                "ModelRunner._maybe_execute_deferred_mamba_cow_and_clear",
                                         required=False,
                                         used_for="private: the model runner's mamba copy-on-write, run unbound"),
    "runner_logical_tokens": Need(target="sglang.srt.model_executor.model_runner:ModelRunner."
                                         "logical_max_total_num_tokens", required=False,
                                  used_for="private: the KV capacity the TP worker reports to its scheduler (its "
                                           "max_total_num_tokens), asked of the runner's configurator"),
    "runner_effective_tokens": Need(target="sglang.srt.model_executor.model_runner:ModelRunner."
                                           "effective_max_total_num_tokens", required=False,
                                    used_for="private: the runner's token capacity, a hybrid SWA server's from its "
                                             "configurator's two pools"),
    "runner_token_pool_size": Need(target="sglang.srt.model_executor.model_runner:ModelRunner.max_token_pool_size",
                                   required=False,
                                   used_for="private: the capacity the TP worker bounds max_req_len by before "
                                            "0.5.16 (a hybrid SWA server's full pool)"),
    "runner_effective_logical_tokens": Need(target="sglang.srt.model_executor.model_runner:ModelRunner."
                                                   "effective_logical_max_total_num_tokens", required=False,
                                            used_for="private: the capacity the TP worker bounds max_req_len by"),
    "runner_mamba_ratio": Need(target="sglang.srt.model_executor.model_runner_kv_cache_mixin:"
                                      "ModelRunnerKVCacheMixin._calculate_mamba_ratio", required=False,
                               used_for="private: mamba slots per request, before the configurator (0.5.12, "
                                        "0.5.13), run unbound"),
    "backend_mamba_cow_and_clear": Need(target=f"{_MAMBA_BACKEND}._execute_deferred_mamba_cow_and_clear",
                                        required=False, used_for="private: the attention backend's mamba "
                                                                 "copy-on-write (0.5.13), run unbound"),
    # the pools a model runner builds before the configurator (0.5.9 to 0.5.15, pools/runner_pools.py)
    "model_runner": Need(target="sglang.srt.model_executor.model_runner:ModelRunner", required=False,
                         used_for="the model runner whose own methods build the pools before 0.5.16"),
    "runner_init_memory_pool": Need(target="sglang.srt.model_executor.model_runner:ModelRunner.init_memory_pool",
                                    required=False,
                                    used_for="the model runner's own pool build (its KV cache mixin, before 0.5.16), "
                                             "run on a runner that holds what its __init__ and initialize set"),
    "runner_kv_dtype": Need(target="sglang.srt.model_executor.model_runner:ModelRunner.configure_kv_cache_dtype",
                            required=False, used_for="the model runner's KV dtype, run unbound on its stand-in "
                                                     "(the configurator's input; before 0.5.16 the runner's own)"),
    "runner_free_memory": Need(target="sglang.srt.model_executor.model_runner_kv_cache_mixin:"
                                      "get_available_gpu_memory", required=False,
                               used_for="private: the free GPU memory a model runner's pool budget starts from "
                                        "(before 0.5.16), stood in for by a fixed budget"),
    "runner_registry_unset": Need(target="sglang.srt.model_executor.model_runner:_UNSET", required=False,
                                  used_for="private: the runner's not-yet-asked linear-attention registry answer "
                                           "(0.5.14, 0.5.15), which its __init__ sets"),
    "init_distributed_environment": Need(target="sglang.srt.distributed.parallel_state:init_distributed_environment",
                                         required=False, used_for="a one-rank model runner's world group (gloo)"),
    "initialize_model_parallel": Need(target="sglang.srt.distributed.parallel_state:initialize_model_parallel",
                                      required=False, used_for="a one-rank model runner's parallel groups"),
    "initialize_dp_attention": Need(target="sglang.srt.layers.dp_attention:initialize_dp_attention", required=False,
                                    used_for="a one-rank model runner's attention-parallel sizes"),
    # the global-ServerArgs loop's sessions (0.5.9 to 0.5.15, scheduling_global.py)
    "session_controller": Need(target="sglang.srt.session.session_controller:SessionController",
                               also=("sglang.srt.managers.session_controller:SessionController",), required=False,
                               used_for="the Scheduler's streaming sessions (0.5.10 on; 0.5.9 keeps a dict)"),
    "streaming_session_flag": Need(target="sglang.srt.server_args:ServerArgs", fields=("enable_streaming_session",),
                                   required=False, used_for="--enable-streaming-session (0.5.10 on)"),
    "track_ssm_indices": Need(target=f"{_MAMBA_BACKEND}._init_track_ssm_indices", required=False,
                              used_for="private: where the kernels snapshot a tracked state (before 0.5.23's "
                                       "ForwardBatch.mamba_track_aligned_lens), run unbound"),
}
# Instance attributes (no class to probe): read where they are, with a default for releases without them.
CONV_WINDOW_PHYS = "_intermediate_conv_window_phys"  # MambaPool: the deduplicated conv-window buffers
MAMBA_CHUNK_MEMO = "_mamba_cache_chunk_size"  # ServerArgs: the mamba checkpoint grid, memoised


@lru_cache(maxsize=None)
def _probed(key: str) -> Probe:
    """A PRIVATE need probed once per process (the release does not change under a run; a decode asks)."""
    return probe(PRIVATE[key])


# The SGLang module that defines a model transformers does not know, by the config architecture that stands for it:
# a release without the module ships no such model, so no server of it builds that model's pools (Inkling came in
# 0.5.16, GLM-5 Next in 0.5.20). Found without importing it (a model's module imports its kernels).
MODEL_MODULES = {"inkling": "sglang.srt.models.inkling", "glm5-next": "sglang.srt.models.glm5_next"}
# Checks that refuse to start a server no request could ever run on, raised while its pools are sized (after its flags
# were accepted): the raising function's name -> (who refuses, SGLang's words where the function raises other errors
# too, else None). An SWA pool below the prefill admission floor (0.5.16 to 0.5.19 inline in the pool configurator's
# _solve_pool_sizes, from 0.5.20 its validate_swa_pool_size); the configurator's state cache too small to serve one
# request.
STARTUP_REFUSALS = {"validate_swa_pool_size": ("SGLang refuses to start", None),
                    "_solve_pool_sizes": ("SGLang refuses to start", "cannot hold even one request"),
                    "resolve_max_num_reqs": ("SGLang refuses to start", None)}
# The error transformers (through huggingface_hub's strict dataclasses) refuses a model's config.json with: no such
# model loads, so no server of it starts (an odd rotary dimension, ...).
MODEL_CONFIG_REFUSALS = {"StrictDataclassClassValidationError": "transformers refuses the model config of"}


def model_missing(architecture: str) -> str | None:
    """Why no server of this release runs the architecture's model (its module is absent), else None."""
    module = MODEL_MODULES.get(architecture)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"sglang {release()} ships no {architecture} model ({module} is absent): no server of it runs one"


def private(key: str):
    """The object a PRIVATE need names, where this release has it; an EngineApiChanged where not."""
    found = _probed(key)
    if found.status != PRESENT:
        raise EngineApiChanged(engine=ENGINE, release=release(), attribute=found.need.target,
                               expected="present (a private name the adapter depends on)", found=found.found)
    return found.value


def has_private(*keys: str) -> bool:
    """Whether this release has every PRIVATE need named (a feature probe: a path declines without them)."""
    return all(_probed(k).status == PRESENT for k in keys)


def private_module(key: str):
    """The module a PRIVATE need is looked up in (for standing in for the name there, where its callers read it)."""
    return importlib.import_module(PRIVATE[key].target.partition(":")[0])


def private_name(key: str) -> str:
    """The attribute name of a PRIVATE need (for binding a borrowed method under SGLang's own name)."""
    return PRIVATE[key].target.partition(":")[2].rpartition(".")[2]


def conv_window_buffers(mamba_pool, default):
    """The MambaPool's physical conv-window buffers where it deduplicates them, else ``default``."""
    return getattr(mamba_pool, CONV_WINDOW_PHYS, default)


def seed_mamba_chunk_size(server_args, value: int) -> None:
    """Pre-seed the server's memoised mamba checkpoint grid (as SGLang's own fixtures do), once."""
    if not hasattr(server_args, MAMBA_CHUNK_MEMO):  # how SGLang's overrides.mamba_cache_chunk_size asks
        setattr(server_args, MAMBA_CHUNK_MEMO, value)


def registered_storage_backends() -> dict:
    """The L3 storage backends SGLang's factory has registered (its private class registry, a dict)."""
    registry = private("storage_registry")
    if not isinstance(registry, dict):
        raise EngineApiChanged(engine=ENGINE, release=release(), attribute=PRIVATE["storage_registry"].target,
                               expected="a dict of backend name to entry", found=type(registry).__name__)
    return registry


def engine_report_needs():
    return (*NEEDS.values(), *PRIVATE.values())
