"""SGLang's scheduler path (``adapters/sglang/scheduler/scheduling.py``): the Scheduler's state and private reads, for a
server built without its model; every name read here is checked, and an ``EngineApiChanged`` when a release drops it."""

from __future__ import annotations

from contextlib import contextmanager

from poolfuzz.adapters.sglang.compat.needs import ENGINE, has_private, private, private_name, release
from poolfuzz.adapters.sglang.compat.scheduler_global import (check_idle_leaks, invariant_checker, pool_stats,
                                                            single_tensor_parallel_rank, tree_sanity_check)
from poolfuzz.errors import EngineApiChanged

# --- the scheduler path (adapters/sglang/scheduler/scheduling.py): a server's Scheduler without its model -------------
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
RESULT_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor"
TOKEN_RATIO = "sglang.srt.managers.scheduler_components.new_token_ratio_tracker:NewTokenRatioTracker"
# The Scheduler's own methods the driver calls (what they call on it is the release's business).
SCHEDULER_METHODS = ("get_next_batch_to_run", "update_running_batch", "abort_request", "init_req_max_new_tokens",
                     "_add_request_to_queue", "init_pool_stats_observer", "init_invariant_checker", "is_fully_idle")


def scheduler_state(*, tree, req_to_token_pool, allocator, model_config, spec_algorithm, disaggregation_mode,
                    flags: dict, page_size: int, is_hybrid_ssm: bool, sliding_window_size: int | None,
                    swa_tokens: tuple[int | None, int | None], max_running_requests: int, max_total_num_tokens: int,
                    max_req_len: int, max_req_input_len: int, policy, token_ratio, processor,
                    enable_hierarchical_cache: bool = False, enable_hicache_storage: bool = False,
                    enable_unified_memory: bool = False) -> dict:
    """What ``Scheduler.__init__`` leaves on a server with the published ``flags`` (``publish_scheduler_context``), a
    radix cache and no model, for the event-loop methods the scheduler path calls (its ``__init__`` builds a
    TpModelWorker, which loads a model on a GPU). Every feature flag is the server's default (off) but
    ``enable_hierarchical_cache``, a HiCache server's, ``enable_unified_memory``, a unified-memory server's, and ``enable_hicache_storage``, which ``__init__`` reads off the
    published ``--hicache-storage-backend`` (the tree's build has one where it built an L3 tier); collaborators the methods only notify are no-ops."""
    from collections import deque
    from types import SimpleNamespace as NS

    from sglang.srt.runtime_context import get_server_args

    noop = lambda *args, **kwargs: None  # noqa: E731
    same = lambda batch, **kwargs: batch  # noqa: E731
    return dict(
        # queues and running state (init_running_status; the chunk state is compat.init_chunked_prefill's)
        waiting_queue=[], last_batch=None, result_queue=deque(),
        forward_ct=0, processed_tokens_counter=0, enable_skip_finishing_decode=False, _sched_idled=False,
        enable_continuous_input_polling=False,
        # pools, model and policy
        tree_cache=tree, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, device="cpu", model_config=model_config, spec_algorithm=spec_algorithm, enable_overlap=False,
        dllm_config=None, policy=policy, new_token_ratio_tracker=token_ratio, is_generation=True,
        max_prefill_tokens=flags["max_prefill_tokens"],  # the chunk size: init_chunked_prefill's
        max_running_requests=max_running_requests, max_req_input_len=max_req_input_len, max_prefill_bs=0,
        max_total_num_tokens=max_total_num_tokens, max_req_len=max_req_len, kv_shard_widening=1,
        max_new_tokens_limit=None, sliding_window_size=sliding_window_size,
        truncation_align_size=None, dynamic_chunk_sizer=None, prefill_delayer=None,
        min_free_slots_delayer=None, priority_scheduling_preemption_threshold=flags["priority_scheduling_preemption_threshold"],
        enable_priority_preemption=False,
        enable_priority_scheduling=False, schedule_low_priority_values_first=False,
        abort_on_priority_when_disabled=False, max_queued_requests=None, is_hybrid_swa=sliding_window_size is not None, enable_lora=False,
        enable_hierarchical_cache=enable_hierarchical_cache, enable_hicache_storage=enable_hicache_storage, enable_lmcache=False,
        enable_unified_memory=enable_unified_memory, enable_unified_cache_external_linker=False, enable_hisparse=False, hisparse_coordinator=None,
        require_mlp_sync=False, prefill_decode_interval=0, _prefill_decode_interval_remaining=0,
        prefill_decode_interval_min_bs=0, disaggregation_mode=disaggregation_mode, decode_offload_manager=None,
        scheduler_stage_metrics=None, mm_receiver=None, is_hybrid_ssm=is_hybrid_ssm,
        full_tokens_per_layer=swa_tokens[0], swa_tokens_per_layer=swa_tokens[1], _engine_paused=False,
        _pp_microbatches_drained=lambda: True,
        # collaborators, reduced to what those methods call
        session_controller=NS(sessions={}), dllm_manager=NS(any_staging_reqs=lambda: False),
        grammar_manager=NS(has_waiting_grammars=lambda: False, abort_requests=noop, grammar_queue=[], clear=noop),
        cur_batch_for_debug=None, draft_worker=None,  # what flush_cache resets, and the draft worker it clears
        dp_attn_adapter=NS(maybe_prepare_mlp_sync_batch=same, maybe_convert_decode_to_extend=same),
        ngram_embedding_manager=NS(prepare_for_forward=same),
        tp_worker=NS(model_runner=NS(attn_backend=NS(), prefill_aware_swa=False)),
        beam_coordinator=NS(pending_member_rows=lambda batch: 0, retire_group=noop),
        load_inquirer=NS(_get_num_pending_tokens=lambda **kwargs: 0),
        metrics_reporter=NS(enable_metrics=False, num_retracted_reqs=0, record_scheduler_active=noop,
                            reset_metrics=noop, is_stats_logging_rank=False),
        send_abort_output=noop, result_processor=processor,
        # read by 0.5.18's event-loop methods (later releases moved them into components)
        server_args=get_server_args(), enable_fpm=False, enable_dynamic_chunking=False, ipc_channels=NS(send_to_tokenizer=NS(send_output=noop)),
        ps=NS(tp_rank=0, pp_rank=0, attn_cp_rank=0, dp_rank=None, tp_size=1, pp_size=1, dp_size=1, attn_tp_size=1,
              attn_tp_rank=0, attn_dp_rank=0))


def idle_compaction(server) -> None:
    """``on_idle``'s lazy compaction of a fully idle server's unified memory pool (``flush_opportunistic``, which moves
    rows between physical pages and rebinds the tables; the Scheduler swallows its errors, and so does this)."""
    if server.enable_unified_memory:
        try:
            server.token_to_kv_pool_allocator.flush_opportunistic()
        except Exception:  # noqa: BLE001 - on_idle's own ``except Exception: pass``
            pass


def published_extra_buffer() -> bool:
    """Whether the published server keeps mamba extra buffers: the derived ``exec.mamba`` leaf (0.5.23), else the
    published ``ServerArgs``' own ``enable_mamba_extra_buffer()`` (0.5.18's context has no such leaf)."""
    from sglang.srt import runtime_context

    try:
        return runtime_context.get_exec().mamba.enable_mamba_extra_buffer
    except AttributeError:
        return runtime_context.get_server_args().enable_mamba_extra_buffer()


def host_tier_pools(tree) -> list[tuple]:
    """``(host pool, the device pool it mirrors)`` for each host pool of ``tree``: a ``UnifiedRadixCache``'s pool
    group (0.5.20 on; 0.5.17's in its ``token_to_kv_pool_host``), or the one host pool of 0.5.18's ``HiRadixCache``;
    none for a tree without a host tier. A tree a ``StreamingSession`` wraps (``--enable-streaming-session``) is asked
    through the wrapper."""
    tree = wrapped_tree(tree)
    group = tree.__dict__.get("host_pool_group")
    host = tree.__dict__.get("token_to_kv_pool_host")
    if group is None and hasattr(host, "entries"):  # 0.5.17 keeps its HostPoolGroup as the tree's host pool
        group = host
    if group is not None:
        return [(entry.host_pool, entry.device_pool) for entry in group.entries]
    return [] if host is None else [(host, host.device_pool)]


def wrapped_tree(tree):
    """The prefix cache a ``StreamingSession`` wraps (its ``inner``: a global-ServerArgs server started with
    ``--enable-streaming-session`` whose tree keeps no session slots itself), or ``tree`` itself."""
    return tree.__dict__.get("inner", tree)


def host_pools(tree) -> list:
    """The host pools of a tree with a host tier (:func:`host_tier_pools`)."""
    return [host for host, _ in host_tier_pools(tree)]


def published_host_pool_backup() -> bool:
    """Whether the published server backs retracted decode requests up into a host pool (its resolved
    ``--disaggregation-decode-retraction-backup``)."""
    return published_retraction_backup() == "host_pool"


def published_retraction_backup() -> str | None:
    """The published server's ``--disaggregation-decode-retraction-backup`` (None: unset, or a release before the
    flag, 0.5.17 and earlier, whose decode retraction backs requests up as per-request CPU tensors)."""
    try:
        return published_namespace("disagg").disaggregation_decode_retraction_backup
    except AttributeError:  # the namespace (or, on 0.5.16, the ServerArgs) has no such leaf
        return None


def namespace_published(context, name: str) -> bool:
    """Whether SGLang's runtime context has projected the config namespace ``name`` from a published ServerArgs:
    ``is_config_namespace_published`` (0.5.18 on); 0.5.17 has the namespaces but not that question, and its
    ``config_bag`` fails closed (ValueError) until they are projected; 0.5.16 has no namespaces, and its published
    ServerArgs stands for all of them (``server_args`` fails closed the same way)."""
    probe = getattr(context, "is_config_namespace_published", None)
    if probe is not None:
        return probe(name)
    try:
        if hasattr(context, "config_bag"):
            context.config_bag(name)
        else:  # 0.5.16: no namespaces, the published ServerArgs is the whole configuration
            context.server_args
    except ValueError:
        return False
    return True


def published_namespace(namespace: str):
    """The published server's config namespace ``namespace`` (``get_<namespace>()``, 0.5.17 on), or on 0.5.16, whose
    context has no namespaces, the published ServerArgs, which holds the same flags under the same names."""
    from sglang.srt import runtime_context

    getter = getattr(runtime_context, f"get_{namespace}", None)
    return getter() if getter is not None else runtime_context.get_server_args()


@contextmanager
def memory_flags(**flags):
    """The published server's memory flags set to ``flags`` for the span of a tree's build: the ``memory`` namespace's
    scoped override (0.5.17 on), or on 0.5.16 the ServerArgs' own ``override``, and the old values back after."""
    from sglang.srt import runtime_context

    if hasattr(runtime_context, "get_memory"):
        with runtime_context.get_memory().override(**flags):
            yield
        return
    args = runtime_context.get_server_args()
    before = {name: getattr(args, name) for name in flags}
    args.override("poolfuzz.tree_build", **flags)
    try:
        yield
    finally:
        args.override("poolfuzz.tree_build", **before)


def has_retraction_backup_flag() -> bool:
    """Whether the release's ServerArgs has ``--disaggregation-decode-retraction-backup`` (0.5.18 on); before it a
    decode server backs every retracted request up as per-request CPU tensors, with nothing to choose."""
    import inspect

    from sglang.srt.server_args import ServerArgs

    return "disaggregation_decode_retraction_backup" in inspect.signature(ServerArgs).parameters


def resolve_decode_retraction_backup(worker) -> str:
    """The decode retraction backup SGLang resolves for a server with ``worker``'s pools
    (``kv_cache_builder.resolve_decode_retraction_backup``, which lands it in the runtime context with the host pool's
    ratio); on a release without that resolution, the published flag, unset meaning per-request CPU tensors (the path
    before host-pool retraction, sglang#34801)."""
    try:
        from sglang.srt.mem_cache.kv_cache_builder import resolve_decode_retraction_backup as resolve
    except ImportError:
        return (has_retraction_backup_flag() and published_retraction_backup()) or "cpu_tensor"
    return resolve(tp_worker=worker)


def publish_scheduler_context(*, max_running_requests: int) -> dict:
    """What a launcher and ``Scheduler.__init__`` publish into the runtime context besides the server's arguments
    (published with the tree, ``server_args.publish_server_args``): the single tensor-parallel rank of a CPU run and,
    with no micro-batch size set, one pipeline stage's worth of running requests
    (``scheduler.pp_max_micro_batch_size_default``). Returns the scheduling flags the Scheduler keeps, as published."""
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import get_parallel, get_server_args

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
    published = {name: getattr(published_namespace("schedule"), name) for name in SCHEDULE_FLAGS}
    # 0.5.16's context has no namespaces: its ServerArgs holds the micro-batch size and takes the override itself
    namespaced = hasattr(runtime_context, "get_schedule")
    holder, writer = (parallel, runtime_context.get_context()) if namespaced else (get_server_args(),) * 2
    if not holder.pp_max_micro_batch_size:
        writer.override("scheduler.pp_max_micro_batch_size_default",
                        pp_max_micro_batch_size=max(max_running_requests // parallel.pp_size, 1))
    return published


def relay_future_map(spec_algorithm, req_to_token_pool):
    """The FutureMap ``Scheduler.init_overlap`` leaves a server without the overlap schedule: the speculative
    algorithm's (0.5.14 on, where the input-id relay is always on), without the CPU copy of the sequence lengths (which
    only some GPU attention backends ask) or a confidence relay; None before 0.5.14 (no map without overlap)."""
    import inspect

    create = getattr(type(spec_algorithm), "create_future_map", None)
    if create is None:
        return None
    wanted = {"needs_cpu_seq_lens": False, "needs_confidence_relay": False}
    accepted = inspect.signature(create).parameters
    return spec_algorithm.create_future_map("cpu", req_to_token_pool,
                                            **{k: v for k, v in wanted.items() if k in accepted})


def resolved_to_sglangs_own_model(model_config) -> None:
    """The model resolved to one of SGLang's own implementations, not the Transformers backend (under which the tree
    and chunking differ): ``_resolved_model_impl``, the cache ``get_resolved_model_impl`` reads before it would look
    the model's architecture up."""
    from sglang.srt.configs.model_config import ModelImpl

    model_config._resolved_model_impl = ModelImpl.SGLANG


def init_chunked_prefill(server) -> None:
    """The Scheduler's own ``init_chunked_prefill`` on the stand-in ``server``: its chunk size from the published
    ``--chunked-prefill-size`` (one <= 0 is no chunking), its mixed-chunk and chunk state, for a model of SGLang's
    own implementations."""
    resolved_to_sglangs_own_model(server.model_config)
    type(server).init_chunked_prefill(server)


def token_ratio(cls):
    """The Scheduler's ``NewTokenRatioTracker`` for the published server: ``from_config`` (0.5.18 on reads the
    context), ``from_server_args`` of the published arguments on 0.5.16 and 0.5.17."""
    if hasattr(cls, "from_config"):
        return cls.from_config()
    from sglang.srt.runtime_context import get_server_args

    return cls.from_server_args(get_server_args())


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
                                      forward_ct_decode=0, snapshot_spec_decode_metrics=noop,
                                      update_spec_metrics=noop),
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
                check_idle_leaks(checker, lambda: pool_stats(server))
                sanity = getattr(envs, "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", None)  # 0.5.23 gates it
                with sanity.override(True) if sanity is not None else nullcontext():
                    tree_sanity_check(checker)  # the tree's sanity check, where the server runs one for the model
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


def req_to_token_headroom() -> int | None:
    """The columns a server's ``req_to_token`` rows have past the context (``get_req_to_token_extra_context_len``, of the
    published server's page size and speculative flags), or None: a release without that sizing, or no server with a
    page size published yet (pools built on their own). 0.5.16 and 0.5.17 size it from the ServerArgs they are
    handed, the published one; 0.5.18 on read the published server themselves."""
    import inspect

    try:
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        return None
    if published_namespace("schedule").page_size is None:
        return None
    if inspect.signature(get_req_to_token_extra_context_len).parameters:
        return get_req_to_token_extra_context_len(get_server_args())
    return get_req_to_token_extra_context_len()


_RUNNER_TOKENS = ("runner_logical_tokens", "runner_effective_tokens", "runner_effective_logical_tokens")


def worker_token_capacity(family) -> tuple[int, int]:
    """``(max_total_num_tokens, the capacity max_req_len is bounded by)`` as ``TpModelWorker.get_worker_info`` hands
    them to its scheduler, asked of the model runner's own properties, run on a runner stand-in that holds what the
    runner holds after ``init_memory_pool`` (the pools SGLang built, the sizes it chose, the configurator, which the
    capacities ask):

    - 0.5.21 on: its ``logical_max_total_num_tokens`` and ``effective_logical_max_total_num_tokens``;
    - 0.5.16 to 0.5.20: its ``max_total_num_tokens`` (through the request pool's ``schedulable_token_capacity`` where
      the pool has it, 0.5.19 on) and ``effective_max_total_num_tokens``;
    - before: its ``max_total_num_tokens`` and ``max_token_pool_size``.

    A hybrid SWA server's bound is its full pool, not the window side's free count (which refused a prompt longer
    than the window pool at admission, hiding the SWA defects of docs/bugs/sglang-swa-*.md on 0.5.16 to 0.5.20 until
    stop 67). A release with none of those properties: the allocator's free tokens, for both."""
    served = family.served
    sizes = served.sizes
    runner_state = dict(
        req_to_token_pool=served.req_to_token_pool, token_to_kv_pool_allocator=served.allocator,
        kv_cache_configurator=served.configurator, max_total_num_tokens=sizes["max_total_num_tokens"],
        is_hybrid_swa=family.config.has_swa if served.configurator is None else served.configurator.is_hybrid_swa,
        full_max_total_num_tokens=sizes["full_max_total_num_tokens"],
        swa_max_total_num_tokens=sizes["swa_max_total_num_tokens"])
    if served.configurator is not None and has_private(*_RUNNER_TOKENS):
        runner = _runner_standin(_RUNNER_TOKENS, runner_state)
        return (getattr(runner, private_name("runner_logical_tokens")),
                getattr(runner, private_name("runner_effective_logical_tokens")))
    bound = next((key for key in ("runner_effective_tokens", "runner_token_pool_size") if has_private(key)), None)
    if bound is None or sizes["max_total_num_tokens"] is None:
        total = family.sg_allocator.available_size()
        return total, total
    capacity = getattr(served.req_to_token_pool, "schedulable_token_capacity", None)
    total = sizes["max_total_num_tokens"]
    return (capacity(total) if capacity is not None else total,
            getattr(_runner_standin((bound,), runner_state), private_name(bound)))


def _runner_standin(keys: tuple[str, ...], state: dict):
    """A model-runner stand-in with SGLang's own properties ``keys`` (PRIVATE needs), holding ``state``."""
    properties = {private_name(key): property(private(key).fget) for key in keys}
    runner = type("ModelRunnerStandIn", (), properties)()
    runner.__dict__.update(state)
    return runner
