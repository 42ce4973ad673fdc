"""What the sglang families need of the installed SGLang, listed once: where each class lives across
releases, which are needed and which are features the adapter probes and does without.

``api.load`` resolves every :class:`~poolfuzz.adapters.engine_api.Need` here into an ``SGLangAPI``; a
needed one that the installed release lacks is an ``EngineApiChanged`` (verdict "API CHANGED", exit 2,
no artifact), never a finding. ``poolfuzz doctor --family sglang`` prints the same probes.
"""

from __future__ import annotations

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
    "Mamba2CacheParams": Need(target="sglang.srt.configs.mamba_utils:Mamba2CacheParams", used_for="mamba shapes"),
    "Mamba2StateShape": Need(target="sglang.srt.configs.mamba_utils:Mamba2StateShape", used_for="mamba shapes"),
    "Mamba2StateDType": Need(target="sglang.srt.configs.mamba_utils:Mamba2StateDType", required=False,
                             used_for="mamba state dtypes"),
    "Req": Need(target=f"{_SB}:Req", used_for="every request, and its retraction path"),
    "ReqKvInfo": Need(target=f"{_SB}:ReqKvInfo", required=False,
                      used_for="a request's KV fields on req.kv (absent: flat on the Req)"),
    "RetractionBackup": Need(target="sglang.srt.mem_cache.common:RetractionBackup", required=False,
                             used_for="a retracted request's backup record"),
    "free_swa_out_of_window_slots": Need(target="sglang.srt.mem_cache.common:free_swa_out_of_window_slots",
                                         required=False, used_for="SWA eviction"),
    "free_kv_row_segments": Need(target="sglang.srt.mem_cache.common:free_kv_row_segments", required=False,
                                 used_for="freeing a row's KV"),
    "ComponentType": Need(target="sglang.srt.mem_cache.unified_cache.component_type:ComponentType",
                          also=("sglang.srt.mem_cache.base_prefix_cache:ComponentType",
                                "sglang.srt.mem_cache.common:ComponentType"), required=False,
                          used_for="the unified tree's components"),
    "ScheduleBatch": Need(target=f"{_SB}:ScheduleBatch", required=False,
                          used_for="the decode admission check and SWA eviction trigger"),
    "ensure_mamba_capacity": Need(target="sglang.srt.mem_cache.allocation:ensure_mamba_capacity", required=False,
                                  used_for="mamba admission"),
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
    "swa_eviction_trigger": Need(target=f"{_SB}:ScheduleBatch._swa_eviction_trigger", required=False,
                                 used_for="private: the decode-time SWA eviction trigger, run unbound"),
    "check_all_pools": Need(target=f"{_CHECKER}._check_all_pools", required=False,
                            used_for="private: the scheduler's idle leak check"),
    "check_req_pool": Need(target=f"{_CHECKER}._check_req_pool", required=False,
                           used_for="private: the scheduler's idle request-row leak check"),
    "cuda_host_register": Need(target="sglang.srt.mem_cache.pool_host.common:_cuda_host_register", required=False,
                               used_for="private: replaced by a no-op on a machine without CUDA"),
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
    "calculate_mamba_ratio": Need(target="sglang.srt.mem_cache.kv_cache_configurator:"
                                         "KVCacheConfigurator._calculate_mamba_ratio", required=False,
                                  used_for="private: mamba slots per request where a tree caches state"),
    "deferred_mamba_cow_and_clear": Need(target="sglang.srt.model_executor.model_runner:"
                                                "ModelRunner._maybe_execute_deferred_mamba_cow_and_clear",
                                         required=False,
                                         used_for="private: the model runner's mamba copy-on-write, run unbound"),
    "runner_mamba_ratio": Need(target="sglang.srt.model_executor.model_runner_kv_cache_mixin:"
                                      "ModelRunnerKVCacheMixin._calculate_mamba_ratio", required=False,
                               used_for="private: mamba slots per request, before the configurator (0.5.12, "
                                        "0.5.13), run unbound"),
    "backend_mamba_cow_and_clear": Need(target=f"{_MAMBA_BACKEND}._execute_deferred_mamba_cow_and_clear",
                                        required=False, used_for="private: the attention backend's mamba "
                                                                 "copy-on-write (0.5.13), run unbound"),
    "track_ssm_indices": Need(target=f"{_MAMBA_BACKEND}._init_track_ssm_indices", required=False,
                              used_for="private: where the kernels snapshot a tracked state (before 0.5.23's "
                                       "ForwardBatch.mamba_track_aligned_lens), run unbound"),
}
# Where the speculative decode-memory helpers are kept (ScheduleBatch, found by this prefix).
SPEC_DECODE_HELPERS = "_new_tokens_required"
# Instance attributes (no class to probe): read where they are, with a default for releases without them.
CONV_WINDOW_PHYS = "_intermediate_conv_window_phys"  # MambaPool: the deduplicated conv-window buffers
MAMBA_CHUNK_MEMO = "_mamba_cache_chunk_size"  # ServerArgs: the mamba checkpoint grid, memoised


@lru_cache(maxsize=None)
def _probed(key: str) -> Probe:
    """A PRIVATE need probed once per process (the release does not change under a run; a decode asks)."""
    return probe(PRIVATE[key])


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


def private_name(key: str) -> str:
    """The attribute name of a PRIVATE need (for binding a borrowed method under SGLang's own name)."""
    return PRIVATE[key].target.partition(":")[2].rpartition(".")[2]


def speculative_decode_helpers(schedule_batch_cls) -> tuple[str, ...]:
    """The names of ScheduleBatch's private speculative decode-memory helpers (``check_decode_mem`` calls them)."""
    return tuple(n for n in vars(schedule_batch_cls) if n.startswith(SPEC_DECODE_HELPERS))


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


# --- the scheduler path (adapters/sglang/scheduling.py): a server's Scheduler without its model -----------------
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
RESULT_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor"
TOKEN_RATIO = "sglang.srt.managers.scheduler_components.new_token_ratio_tracker:NewTokenRatioTracker"
# The Scheduler's own methods the driver calls (what they call on it is the release's business).
SCHEDULER_METHODS = ("get_next_batch_to_run", "update_running_batch", "abort_request", "init_req_max_new_tokens",
                     "_add_request_to_queue", "init_pool_stats_observer", "init_invariant_checker", "is_fully_idle")


def scheduler_state(*, tree, req_to_token_pool, allocator, model_config, spec_algorithm, disaggregation_mode,
                    flags: dict, page_size: int, is_hybrid_ssm: bool, sliding_window_size: int | None,
                    swa_tokens: tuple[int, int] | None, max_running_requests: int, max_total_num_tokens: int,
                    max_req_len: int, max_req_input_len: int, policy, token_ratio, processor) -> dict:
    """What ``Scheduler.__init__`` leaves on a server with the published ``flags`` (``publish_scheduler_context``), a
    radix cache and no model, for the event-loop methods the scheduler path calls (its ``__init__`` builds a
    TpModelWorker, which loads a model on a GPU). Every feature flag is the server's default (off); collaborators
    the methods only notify are no-ops."""
    from collections import deque
    from types import SimpleNamespace as NS

    from sglang.srt.runtime_context import get_server_args

    noop = lambda *args, **kwargs: None  # noqa: E731
    same = lambda batch, **kwargs: batch  # noqa: E731
    return dict(
        # queues and running state (init_running_status, init_chunked_prefill)
        waiting_queue=[], last_batch=None, chunked_req=None, _pending_chunked_abort_req=None, result_queue=deque(),
        forward_ct=0, processed_tokens_counter=0, enable_skip_finishing_decode=False, _sched_idled=False,
        enable_continuous_input_polling=False,
        # pools, model and policy
        tree_cache=tree, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, device="cpu", model_config=model_config, spec_algorithm=spec_algorithm, enable_overlap=False,
        dllm_config=None, policy=policy, new_token_ratio_tracker=token_ratio, is_generation=True,
        chunked_prefill_size=flags["chunked_prefill_size"], max_prefill_tokens=flags["max_prefill_tokens"],
        max_running_requests=max_running_requests, max_req_input_len=max_req_input_len, max_prefill_bs=0,
        max_total_num_tokens=max_total_num_tokens, max_req_len=max_req_len, kv_shard_widening=1,
        max_new_tokens_limit=None, sliding_window_size=sliding_window_size,
        is_mixed_chunk=False, truncation_align_size=None, dynamic_chunk_sizer=None, prefill_delayer=None,
        min_free_slots_delayer=None, priority_scheduling_preemption_threshold=flags["priority_scheduling_preemption_threshold"],
        enable_priority_preemption=False,
        enable_priority_scheduling=False, schedule_low_priority_values_first=False,
        abort_on_priority_when_disabled=False, max_queued_requests=None, is_hybrid_swa=sliding_window_size is not None, enable_lora=False,
        enable_hierarchical_cache=False, enable_hicache_storage=False, enable_lmcache=False,
        enable_unified_cache_external_linker=False, enable_hisparse=False, hisparse_coordinator=None,
        require_mlp_sync=False, prefill_decode_interval=0, _prefill_decode_interval_remaining=0,
        prefill_decode_interval_min_bs=0, disaggregation_mode=disaggregation_mode, decode_offload_manager=None,
        scheduler_stage_metrics=None, mm_receiver=None, is_hybrid_ssm=is_hybrid_ssm,
        full_tokens_per_layer=swa_tokens[0] if swa_tokens else None,
        swa_tokens_per_layer=swa_tokens[1] if swa_tokens else None, _engine_paused=False,
        _pp_microbatches_drained=lambda: True,
        # collaborators, reduced to what those methods call
        session_controller=NS(sessions={}), dllm_manager=NS(any_staging_reqs=lambda: False),
        grammar_manager=NS(has_waiting_grammars=lambda: False, abort_requests=noop, grammar_queue=[]),
        dp_attn_adapter=NS(maybe_prepare_mlp_sync_batch=same, maybe_convert_decode_to_extend=same),
        ngram_embedding_manager=NS(prepare_for_forward=same),
        tp_worker=NS(model_runner=NS(attn_backend=NS(), prefill_aware_swa=False)),
        beam_coordinator=NS(pending_member_rows=lambda batch: 0, retire_group=noop),
        load_inquirer=NS(_get_num_pending_tokens=lambda **kwargs: 0),
        metrics_reporter=NS(enable_metrics=False, num_retracted_reqs=0, record_scheduler_active=noop),
        send_abort_output=noop, result_processor=processor,
        # read by 0.5.18's event-loop methods (later releases moved them into components)
        server_args=get_server_args(), enable_fpm=False, enable_dynamic_chunking=False, ipc_channels=NS(send_to_tokenizer=NS(send_output=noop)),
        ps=NS(tp_rank=0, pp_rank=0, attn_cp_rank=0, dp_rank=None, tp_size=1, pp_size=1, dp_size=1, attn_tp_size=1,
              attn_tp_rank=0, attn_dp_rank=0))


def published_extra_buffer() -> bool:
    """Whether the published server keeps mamba extra buffers: the derived ``exec.mamba`` leaf (0.5.23), else the
    published ``ServerArgs``' own ``enable_mamba_extra_buffer()`` (0.5.18's context has no such leaf)."""
    from sglang.srt import runtime_context

    try:
        return runtime_context.get_exec().mamba.enable_mamba_extra_buffer
    except AttributeError:
        return runtime_context.get_server_args().enable_mamba_extra_buffer()


def publish_scheduler_context(*, max_running_requests: int) -> dict:
    """What a launcher and ``Scheduler.__init__`` publish into the runtime context besides the server's arguments
    (published with the tree, ``tree_build.publish_server_args``): the single tensor-parallel rank of a CPU run and,
    with no micro-batch size set, one pipeline stage's worth of running requests
    (``scheduler.pp_max_micro_batch_size_default``). Returns the scheduling flags the Scheduler keeps, as published."""
    from sglang.srt.runtime_context import get_context, get_parallel, get_schedule

    parallel = get_parallel()
    try:
        parallel.tp_rank
    except (RuntimeError, ValueError, AssertionError):  # 0.5.18 asserts a tensor-parallel group exists
        if hasattr(type(parallel), "override_permanently"):
            parallel.override_permanently(tp_rank=0)
        try:  # 0.5.20's override lands where its tp_rank does not read: the rank comes from parallel_state's group
            parallel.tp_rank
        except (RuntimeError, ValueError, AssertionError):  # 0.5.18's context has no override at all
            single_tensor_parallel_rank()
    schedule = get_schedule()
    published = {name: getattr(schedule, name) for name in SCHEDULE_FLAGS}
    if not get_parallel().pp_max_micro_batch_size:
        get_context().override("scheduler.pp_max_micro_batch_size_default",
                               pp_max_micro_batch_size=max(max_running_requests // get_parallel().pp_size, 1))
    return published


# The published scheduling flags the Scheduler copies onto itself (its __init__ reads get_schedule()).
SCHEDULE_FLAGS = ("schedule_policy", "chunked_prefill_size", "max_prefill_tokens", "schedule_conservativeness",
                  "priority_scheduling_preemption_threshold")


def result_processor(cls, *, tree, req_to_token_pool, allocator, model_config, disaggregation_mode):
    """SGLang's own ``SchedulerBatchResultProcessor`` over the server's pools and tree (what turns a forward's tokens
    into outputs, finishes requests and caches them); its streamer and metrics are no-ops."""
    from types import SimpleNamespace as NS

    noop = lambda *args, **kwargs: None  # noqa: E731
    wanted = dict(is_generation=True, disaggregation_mode=disaggregation_mode, enable_overlap=False,
                  enable_overlap_mlx=False, model_config=model_config, token_to_kv_pool_allocator=allocator,
                  tree_cache=tree, hisparse_coordinator=None, req_to_token_pool=req_to_token_pool,
                  decode_offload_manager=None, metrics_collector=None,
                  metrics_reporter=NS(report_prefill_stats=noop, report_decode_stats=noop, num_generated_tokens=0,
                                      forward_ct_decode=0),
                  draft_worker=None, model_worker=NS(), logprob_result_processor=None,
                  output_streamer=NS(stream_output=noop), beam_coordinator=NS(commit_decode=lambda batch: set()),
                  abort_request=noop)
    fields = getattr(cls, "__dataclass_fields__", {})
    if "server_args" in fields:  # 0.5.18 reads the server's arguments off the processor, not the context
        from sglang.srt.runtime_context import get_server_args

        wanted["server_args"] = get_server_args()
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields is None:
        raise EngineApiChanged(engine=ENGINE, release=release(), attribute=RESULT_PROCESSOR,
                               expected="a dataclass of the scheduler's collaborators", found=type(cls).__name__)
    from dataclasses import MISSING

    missing = [name for name, f in fields.items()
               if name not in wanted and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise EngineApiChanged(engine=ENGINE, release=release(), attribute=RESULT_PROCESSOR,
                               expected="the fields the scheduler path fills", found=f"also needs {missing}")
    return cls(**{k: v for k, v in wanted.items() if k in fields})


def engine_invariant_problem(server, *, idle: bool, conservation: bool = True) -> str | None:
    """SGLang's own ``SchedulerInvariantChecker`` on the server (built by the Scheduler's ``init_pool_stats_observer``
    / ``init_invariant_checker``), as a server run with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``,
    ``SGLANG_CHECK_KV_PAGE_INVARIANTS`` and ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` runs it: after a batch,
    exact slot conservation and no page both owned and free (or free twice); when fully idle, ``on_idle``'s pool and
    request-row leak checks and the tree's ``sanity_check``. Its message where one fails, else None. Without
    ``conservation``, the busy check's slot count is left out (a PD decode server's loop never runs it: requests
    pre-allocated for a transfer hold slots outside every batch it counts)."""
    from contextlib import nullcontext

    from sglang.srt.environ import envs

    checker = invariant_checker(server)
    try:
        with envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(True):
            if idle:
                has_leak, messages = checker._check_all_pools(pool_stats(server))
                if has_leak:
                    checker._report_leak("pool", "\n".join(messages))
                checker._check_req_pool()
                sanity = getattr(envs, "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", None)  # 0.5.23 gates it
                with sanity.override(True) if sanity is not None else nullcontext():
                    checker._check_tree_cache()  # the tree's sanity check, where the server runs one for the model
            else:
                if conservation:
                    checker.self_check_during_busy()
                if callable(getattr(type(checker), "_check_kv_page_invariants", None)):  # 0.5.23's page check
                    checker._check_kv_page_invariants()
    except (AssertionError, ValueError) as exc:
        return str(exc).strip()
    return None


def deferred_mamba_cow_and_clear():
    """The GPU model runner's deferred mamba copy-on-write and clear, run before an extend's forward (unbound; the
    attention backend's on 0.5.13), or None where the release has none."""
    for key in ("deferred_mamba_cow_and_clear", "backend_mamba_cow_and_clear"):
        if has_private(key):
            return private(key)
    return None


def mamba_track_aligned_lens(model_chunk: int = 64):
    """How many of an extend's tokens the state the kernels snapshot for the radix tree covers, as a function of
    (track mask, track seqlens, prefix lens, extend lens): ``ForwardBatch.mamba_track_aligned_lens`` (SGLang's "sole
    home of this math", 0.5.23), else what the attention backend's ``_init_track_ssm_indices`` picks (0.5.12, 0.5.13:
    the final state, or the kernel's intermediate state ``h`` at a chunk boundary); None where the release has
    neither. ``model_chunk``: the model's ``mamba_chunk_size`` (the kernels' chunk, where a backend reads its own)."""
    import importlib
    from types import SimpleNamespace

    try:
        forward_batch = importlib.import_module("sglang.srt.model_executor.forward_batch_info").ForwardBatch
    except (ImportError, AttributeError):
        return None
    method = vars(forward_batch).get("mamba_track_aligned_lens")
    if method is not None:
        return lambda mask, seqlens, prefix_lens, extend_lens: method(SimpleNamespace(
            mamba_track_mask=mask, mamba_track_seqlens=seqlens, extend_prefix_lens=prefix_lens))
    if not has_private("track_ssm_indices"):
        return None
    return _covered_by_track_ssm_indices(private("track_ssm_indices"), model_chunk)


def _covered_by_track_ssm_indices(method, model_chunk: int):
    """``_init_track_ssm_indices`` run unbound on a GDN backend stand-in, read back as tokens covered: each tracked
    request's destination is its own batch index, so the final-state list names the requests whose snapshot is the
    state after the whole extend, and the ``h`` list gives, per request, the index into the kernel's packed chunk
    states (``(extend - 1) // chunk + 1`` a request, in batch order), i.e. the chunk boundary it covers. The chunk is
    the one the method reads: FLA's (0.5.12), the server's mamba checkpoint grid (0.5.13) or the backend's own
    ``mamba_chunk_size``, the model's (0.5.19)."""
    from types import SimpleNamespace

    import torch

    def covered(mask, seqlens, prefix_lens, extend_lens):
        if "FLA_CHUNK_SIZE" in method.__code__.co_names:
            chunk = method.__globals__["FLA_CHUNK_SIZE"]
        elif "mamba_chunk_size" in method.__code__.co_names:  # 0.5.19: the backend's own, the model's chunk
            chunk = model_chunk
        else:
            from sglang.srt.server_args import get_global_server_args

            chunk = get_global_server_args().mamba_cache_chunk_size
        n = len(mask)
        ids = torch.arange(n, dtype=torch.int64)
        batch = SimpleNamespace(mamba_track_mask=mask, extend_seq_lens=extend_lens, mamba_track_indices=ids,
                                mamba_track_seqlens=seqlens, extend_prefix_lens=prefix_lens)
        h_src, h_dst, _, final_dst = method(SimpleNamespace(device="cpu", mamba_chunk_size=model_chunk), ids, batch)
        states = (extend_lens - 1) // chunk + 1
        offsets = torch.cumsum(states, 0) - states
        out = torch.zeros(n, dtype=torch.int64)
        out[final_dst] = extend_lens[final_dst]
        out[h_dst] = (h_src - offsets[h_dst]) * chunk
        return out

    return covered


def batches_defer_mamba_cow(schedule_batch_cls) -> bool:
    """Whether the release's batches carry a mamba copy-on-write for the model runner to run before the forward
    (0.5.13+); before, the tree's match copies the state itself."""
    return "mamba_cow_src_indices" in getattr(schedule_batch_cls, "__dataclass_fields__", {})


def batch_rows(batch):
    """The batch's request rows on the CPU (``req_pool_indices_cpu`` from 0.5.13; the device tensor before)."""
    rows = getattr(batch, "req_pool_indices_cpu", None)
    return batch.req_pool_indices.cpu() if rows is None else rows


def request_row(req) -> int | None:
    """A request's row of the request pool (``req.kv.req_pool_idx`` in 0.5.23; on the ``Req`` itself before)."""
    kv = getattr(req, "kv", None)
    return kv.req_pool_idx if hasattr(kv, "req_pool_idx") else req.req_pool_idx


def batch_prefill_inputs(batch):
    """The token ids an extend feeds (``prefill_input_ids_cpu`` from 0.5.13; the batch's ``input_ids`` before)."""
    ids = getattr(batch, "prefill_input_ids_cpu", None)
    return batch.input_ids.cpu() if ids is None else ids


def physical_mamba_slots(req_pool, index):
    """Mamba indices as the kernels address the state (``translate_mamba_indices``; physical before 0.5.23)."""
    translate = getattr(type(req_pool), "translate_mamba_indices", None)
    return index if translate is None else req_pool.translate_mamba_indices(index)


def queue_request(server, req) -> None:
    """``Scheduler._add_request_to_queue``: where ``handle_generate_request`` ends, the request joins the queue."""
    server._add_request_to_queue(req)


def requests_owning_rows(server) -> list:
    """The requests SGLang's invariant checker counts as holding a request row (``_requests_owning_rows``: the last
    and running batches and the chunked request, those whose KV is held); empty where the release's checker has no
    such list (before 0.5.23: the message then names no holder)."""
    checker = invariant_checker(server)
    if not callable(getattr(type(checker), "_requests_owning_rows", None)):
        return []
    return checker._requests_owning_rows()


# --- the scheduler path on releases whose server arguments are one global (scheduling_global.py) ---------------
# The Scheduler's mixin methods that only report (metrics, timers, health checks, idle sleep): no-ops on 0.5.12.
SCHEDULER_REPORTERS = ("stream_output", "report_prefill_stats", "report_decode_stats", "log_batch_result_stats",
                       "update_device_timer", "maybe_send_health_check_signal", "_maybe_clear_mm_inputs",
                       "reset_device_timer_window", "maybe_sleep_on_idle", "_publish_kv_events",
                       "_maybe_log_idle_metrics")
# The Scheduler's own methods the driver calls on a release with one global ServerArgs.
GLOBAL_SCHEDULER_METHODS = ("get_next_batch_to_run", "update_running_batch", "process_batch_result", "on_idle",
                            "abort_request", "init_req_max_new_tokens", "_add_request_to_queue", "is_fully_idle",
                            "init_schedule_policy")
# The Scheduler's init methods that build what its event loop reads over a built tree, in __init__'s order; a
# release runs those it has (the components arrived in 0.5.13).
SCHEDULER_INITS = ("init_schedule_policy", "init_pool_stats_observer", "init_invariant_checker",
                   "init_batch_result_processor")
# The mamba radix cache's strategy flag, by the ServerArgs field each release names it with.
MAMBA_STRATEGY_FLAGS = ("mamba_radix_cache_strategy", "mamba_scheduler_strategy")


def publishes_runtime_context() -> bool:
    """Whether the release keeps a server's arguments in its runtime context (0.5.23) rather than one
    ``ServerArgs`` global set with ``set_global_server_args_for_scheduler`` (0.5.12, 0.5.13)."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.runtime_context") is not None


def server_flags(server_args_cls, flags: dict) -> dict:
    """``flags`` under the names the release's ``ServerArgs`` has (the mamba strategy flag was renamed)."""
    fields = getattr(server_args_cls, "__dataclass_fields__", {})
    out = dict(flags)
    for name in MAMBA_STRATEGY_FLAGS:
        if name in out and name not in fields:
            value = out.pop(name)
            out[next(n for n in MAMBA_STRATEGY_FLAGS if n in fields)] = value
    return out


def single_tensor_parallel_rank() -> None:
    """The tensor- and pipeline-parallel groups of a one-rank CPU run, where none is initialised:
    ``Req.set_finish_with_abort`` asks ``get_tensor_model_parallel_rank()``, 0.5.18's runtime context the pipeline
    world size (each asserts its group exists)."""
    from types import SimpleNamespace

    from sglang.srt.distributed import parallel_state

    for group in ("_TP", "_PP"):
        if getattr(parallel_state, group, None) is None:
            setattr(parallel_state, group, SimpleNamespace(rank_in_group=0, world_size=1))


def has_tree_registry() -> bool:
    """Whether the release picks its prefix tree through ``mem_cache.registry.create_tree_cache`` (0.5.13)."""
    import importlib

    try:
        return callable(getattr(importlib.import_module("sglang.srt.mem_cache.registry"), "create_tree_cache", None))
    except ImportError:
        return False


def scheduler_inits(scheduler_cls) -> tuple[str, ...]:
    """The :data:`SCHEDULER_INITS` this release's Scheduler has."""
    return tuple(name for name in SCHEDULER_INITS if callable(vars(scheduler_cls).get(name)))


def retractions_reset(server) -> None:
    """Zero the step's retraction count where ``update_running_batch`` keeps it on the metrics reporter (0.5.13+)."""
    server.metrics_reporter.num_retracted_reqs = 0


def retractions_counted(server) -> int:
    """The requests ``update_running_batch`` retracted this step: 0.5.12 counts on the Scheduler, later releases on
    its metrics reporter (the other one stays zero)."""
    return server.num_retracted_reqs + server.metrics_reporter.num_retracted_reqs


def invariant_checker(server):
    """What runs the Scheduler's memory checks: its ``SchedulerInvariantChecker`` (0.5.13+), or the Scheduler itself
    (0.5.12's runtime-checker mixin)."""
    return server.invariant_checker if "invariant_checker" in vars(server) else server


def pool_stats(server):
    """The pool counters the checks compare: the pool stats observer's (0.5.13+), or the Scheduler's mixin's."""
    observer = server.pool_stats_observer if "pool_stats_observer" in vars(server) else server
    return observer.get_pool_stats()


def new_request(req_cls, *, rid: str, ids: list[int], sampling_params, vocab_size: int):
    """A ``Req`` as ``handle_generate_request`` builds one for a tokenized prompt: its ids an ``array('q')`` where the
    release types them so (0.5.13+; a list before, which 0.5.12 concatenates with its outputs), and the model's
    vocabulary size where the release takes it (its boundary check of sampled ids)."""
    import inspect
    from array import array

    params = inspect.signature(req_cls.__init__).parameters
    typed_array = "array" in str(params["origin_input_ids"].annotation)
    extra = {"vocab_size": vocab_size} if "vocab_size" in params else {}
    return req_cls(rid=rid, origin_input_text="", origin_input_ids=array("q", ids) if typed_array else list(ids),
                   sampling_params=sampling_params, eos_token_ids=set(), **extra)


def flush_pending_backups(tree) -> None:
    """What ``process_batch_result`` ends with where the tree defers host backups (0.5.23); nothing before."""
    if callable(getattr(type(tree), "flush_pending_backups", None)):
        tree.flush_pending_backups()


def publish_single_rank(cpu_group) -> None:
    """A one-rank CPU server's ranks and attention group, as PD decode queues read them: the runtime context's override
    (0.5.20 on), else (0.5.18, ranks off the Scheduler's ``ps``) ``parallel_state``'s global where none is set."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_parallel

    group = SimpleNamespace(cpu_group=cpu_group, rank_in_group=0, world_size=1)
    parallel = get_parallel()
    if hasattr(type(parallel), "override_permanently"):
        parallel.override_permanently(attn_tp_group=group, pp_rank=0, dp_rank=None, attn_tp_rank=0)
        return
    from sglang.srt.distributed import parallel_state

    if getattr(parallel_state, "_ATTN_TP", None) is None:
        parallel_state._ATTN_TP = group
