"""The scheduler path on releases that keep one global ``ServerArgs`` (0.5.9 to 0.5.15; ``scheduling_global.py``)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from types import SimpleNamespace as NS

from poolfuzz.adapters.sglang.compat.needs import has_private, private

# --- the scheduler path on releases whose server arguments are one global (scheduling_global.py) ---------------
# The Scheduler's mixin methods that only report (metrics, timers, health checks, idle sleep): no-ops on 0.5.12.
SCHEDULER_REPORTERS = ("stream_output", "report_prefill_stats", "report_decode_stats", "log_batch_result_stats",
                       "update_device_timer", "maybe_send_health_check_signal", "_maybe_clear_mm_inputs",
                       "reset_device_timer_window", "maybe_sleep_on_idle", "_publish_kv_events",
                       "_maybe_log_idle_metrics")
# The Scheduler's own methods the driver calls on a release with one global ServerArgs.
GLOBAL_SCHEDULER_METHODS = ("get_next_batch_to_run", "update_running_batch", "process_batch_result",
                            "abort_request", "init_req_max_new_tokens", "_add_request_to_queue", "init_schedule_policy")
# What ``event_loop_normal`` runs on a step without a batch, by the name each release gives it: ``on_idle`` (0.5.11
# on: leak checks, the tree's sanity check, the token-ratio reset) or ``self_check_during_idle`` (0.5.9, 0.5.10:
# ``check_memory``, ``check_tree_cache`` and the same reset).
IDLE_METHODS = ("on_idle", "self_check_during_idle")
# What the Scheduler answers when asked whether it runs nothing: ``is_fully_idle`` (0.5.10 on), or before it the
# question ``flush_cache`` asks, ``_is_no_request`` (no batch running, last or current; 0.5.9).
IDLE_QUESTIONS = ("is_fully_idle", "_is_no_request")
# The Scheduler's init methods that build what its event loop reads over a built tree, in __init__'s order; a
# release runs those it has (the components arrived in 0.5.13).
SCHEDULER_INITS = ("init_chunked_prefill", "init_schedule_policy", "init_pool_stats_observer", "init_invariant_checker",
                   "init_batch_result_processor")
# The call by which a PD decode server names a request's pages to its KV receiver: ``send_metadata`` (0.5.10 on;
# 0.5.10 keeps ``init`` too, for the bootstrap) or 0.5.9's ``init``.
RECEIVER_METADATA_METHODS = ("send_metadata", "init")
# The mamba radix cache's strategy flag, by the ServerArgs field each release names it with.
MAMBA_STRATEGY_FLAGS = ("mamba_radix_cache_strategy", "mamba_scheduler_strategy")


@lru_cache(maxsize=None)  # asked once per class: a flush rule's precondition asks it before every step
def plans_with_context(scheduler_cls) -> bool:
    """Whether the release's Scheduler runs the event loop of a runtime-context server (0.5.16 on, ``ContextLoop``):
    its arguments published in the runtime context (``get_server_args``) and its batches planned over the running and
    last batches it is handed (``get_next_batch_to_run(running_batch, last_batch)``). 0.5.9 to 0.5.15 keep one global
    ``ServerArgs`` (``set_global_server_args_for_scheduler``; on 0.5.15 a shim into a runtime context holding only it
    and the ranks, on 0.5.14 a context of ranks only) and plan with an argument-less ``get_next_batch_to_run()``:
    ``scheduling_global``'s loop."""
    import importlib
    import inspect

    try:
        context = importlib.import_module("sglang.srt.runtime_context")
    except ImportError:
        return False
    return (callable(getattr(context, "get_server_args", None))
            and len(inspect.signature(scheduler_cls.get_next_batch_to_run).parameters) >= 3)


def server_flags(server_args_cls, flags: dict) -> dict:
    """``flags`` under the names the release's ``ServerArgs`` has (the mamba strategy flag was renamed)."""
    fields = getattr(server_args_cls, "__dataclass_fields__", {})
    out = dict(flags)
    for name in MAMBA_STRATEGY_FLAGS:
        renamed = [n for n in MAMBA_STRATEGY_FLAGS if n in fields]
        # only where the class names the flag otherwise (0.5.23's ServerArgs takes its flags through its groups)
        if name in out and name not in fields and renamed:
            out[renamed[0]] = out.pop(name)
    return out


# A runner's ParallelState's decode context-parallel width, by the field each release names it: ``attn_dcp_size``
# (0.5.18 to 0.5.21) or ``dcp_size`` (0.5.17).
DCP_SIZE_FIELDS = ("attn_dcp_size", "dcp_size")


def dcp_size(parallel_state) -> int:
    """``parallel_state``'s decode context-parallel width, under the release's name for it."""
    return next(getattr(parallel_state, name) for name in DCP_SIZE_FIELDS if hasattr(parallel_state, name))


# The MX-style block-16 FP4 KV cache, by the name each release's --kv-cache-dtype takes it: fp4_mx_block16 (0.5.17
# on; from 0.5.18 fp4_e2m1 is a deprecated alias its runner refuses), fp4_e2m1 before.
FP4_KV_NAMES = ("fp4_mx_block16", "fp4_e2m1")


@lru_cache(maxsize=None)
def _flag_choices() -> dict:
    """``--flag`` -> the values SGLang's own launch parser takes for it (``ServerArgs.add_cli_args``), where it names
    them."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {flag: tuple(action.choices) for flag, action in parser._option_string_actions.items() if action.choices}


def release_flag_values(flags: dict) -> dict:
    """``flags`` with the values the release's launch parser names otherwise (the FP4 KV dtype's older name)."""
    out = dict(flags)
    if out.get("kv_cache_dtype") == FP4_KV_NAMES[0]:
        taken = _flag_choices().get("--kv-cache-dtype", FP4_KV_NAMES)
        out["kv_cache_dtype"] = next((n for n in FP4_KV_NAMES if n in taken), FP4_KV_NAMES[0])
    return out


def parser_refusal(flags: dict) -> str | None:
    """What SGLang's own launch parser says of a flag value it does not take (``--kv-cache-dtype mxfp8`` before 0.5.17),
    in argparse's words; None where it takes them all."""
    choices = _flag_choices()
    for name, value in sorted(flags.items()):
        taken = choices.get("--" + name.replace("_", "-"))
        if taken is not None and value is not None and value not in taken:
            return (f"argument --{name.replace('_', '-')}: invalid choice: {value!r} "
                    f"(choose from {', '.join(map(repr, taken))})")
    return None


def runner_state_unasked(runner) -> None:
    """On a model runner made without its ``__init__`` (``pools/runner_pools.py``), what ``__init__`` leaves for its
    methods to fill on first use: 0.5.14 and 0.5.15's linear-attention registry answer, not yet asked."""
    if has_private("runner_registry_unset"):
        runner._linear_attn_registry_cache = private("runner_registry_unset")


class OneRankGroup(NS):
    """A one-rank parallel group's stand-in (rank 0 of 1), where no group is built; real groups replace it."""


_RANK_GROUPS = ("_TP", "_PP")


def single_tensor_parallel_rank() -> None:
    """The tensor- and pipeline-parallel groups of a one-rank CPU run, where none is initialised:
    ``Req.set_finish_with_abort`` asks ``get_tensor_model_parallel_rank()``, 0.5.18's runtime context the pipeline
    world size (each asserts its group exists)."""
    from sglang.srt.distributed import parallel_state

    for group in _RANK_GROUPS:
        if getattr(parallel_state, group, None) is None:
            setattr(parallel_state, group, OneRankGroup(rank_in_group=0, world_size=1))


def rank_standins_cleared() -> None:
    """The stand-ins ``single_tensor_parallel_rank`` set removed, so that SGLang's own one-rank groups are built
    (``initialize_model_parallel`` asserts none exists); they answer what the stand-ins answered."""
    from sglang.srt.distributed import parallel_state

    for group in _RANK_GROUPS:
        if type(getattr(parallel_state, group, None)) is OneRankGroup:
            setattr(parallel_state, group, None)


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


def global_scheduler_state(*, server_args, model_config, spec_algorithm, disaggregation_mode, config, total: int,
                 max_running: int, max_req_len: int, sent) -> dict:
    """What ``Scheduler.__init__`` leaves on a global-ServerArgs server (``scheduling_global``) with ``server_args`` and
    no model, for the event-loop methods
    (the pools and tree are set by :func:`build_tree`); ``sent(output, req)``: what the tokenizer is sent."""
    noop = lambda *args, **kwargs: None  # noqa: E731
    same = lambda batch, **kwargs: batch  # noqa: E731
    ranks = dict(tp_rank=0, pp_rank=0, dp_rank=None, tp_size=1, pp_size=1, dp_size=1, attn_tp_rank=0, attn_tp_size=1,
                 attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0, moe_ep_rank=0, moe_dp_rank=0)
    tokenizer = NS(send_output=sent)
    state = dict(
        ranks, server_args=server_args, schedule_policy=server_args.schedule_policy,
        enable_priority_scheduling=False, abort_on_priority_when_disabled=False,
        schedule_low_priority_values_first=False,
        priority_scheduling_preemption_threshold=server_args.priority_scheduling_preemption_threshold,
        enable_lora=False, enable_lora_overlap_loading=False, enable_overlap=False, enable_overlap_mlx=False,
        enable_pdmux=False, skip_tokenizer_init=True, tokenizer=None, stream_interval=1,
        spec_algorithm=spec_algorithm, page_size=config.page_size,
        enable_hierarchical_cache=server_args.enable_hierarchical_cache,
        enable_hicache_storage=server_args.hicache_storage_backend is not None, enable_hisparse=False, hisparse_coordinator=None, model_config=model_config,
        is_generation=True, attn_tp_cpu_group=None, tp_cpu_group=None, attn_cp_cpu_group=None, tp_group=None,
        enable_metrics=False, enable_kv_cache_events=False, current_scheduler_metrics_enabled=False,
        # init_model_worker: the TpModelWorker's sizes
        max_total_num_tokens=total, max_prefill_tokens=server_args.max_prefill_tokens,
        max_running_requests=max_running, max_queued_requests=None, max_req_len=max_req_len,
        max_req_input_len=max_req_len - 5, device="cpu",
        # init_running_status, init_chunked_prefill, init_schedule_policy, init_disaggregation
        waiting_queue=[], cur_batch=None, last_batch=None, forward_ct=0, return_health_check_ipcs=[],
        _pending_flush=None, num_retracted_reqs=0, num_paused_reqs=0, forward_sleep_time=None, _engine_paused=False,
        chunked_prefill_size=server_args.chunked_prefill_size, chunked_req=None,
        _chunked_req_scheduled_last_iter=False, is_mixed_chunk=False, enable_dynamic_chunking=False,
        prefill_delayer=None, min_free_slots_delayer=None, max_prefill_bs=0, enable_priority_preemption=False,
        disaggregation_mode=disaggregation_mode, decode_offload_manager=None, dllm_config=None, enable_fpm=False,
        require_mlp_sync=False, truncation_align_size=None, use_ngram_embedding=False, num_generated_tokens=0,
        forward_ct_decode=0, metrics_collector=None, draft_worker=None, model_worker=NS(),
        # the TpModelWorker, as far as prefill asks it (0.5.15: the runner's prefill-aware SWA flag, off by default);
        # 0.5.12's build_tree replaces it with the worker its tree is built from
        tp_worker=NS(model_runner=NS(prefill_aware_swa=False)),
        # collaborators the event-loop methods only notify
        send_to_tokenizer=tokenizer, ipc_channels=NS(send_to_tokenizer=tokenizer),
        grammar_manager=NS(has_waiting_grammars=lambda: False, abort_requests=noop, grammar_queue=[],
                           get_ready_grammar_requests=lambda: [], process_req_with_grammar=lambda req: False,
                           __len__=lambda: 0),
        dllm_manager=NS(any_staging_reqs=lambda: False),
        metrics_reporter=NS(enable_metrics=False, num_retracted_reqs=0, report_prefill_stats=noop,
                            report_decode_stats=noop, num_generated_tokens=0, forward_ct_decode=0,
                            log_batch_result_stats=noop, update_device_timer=noop, _maybe_log_idle_metrics=noop,
                            reset_device_timer_window=noop, increment_retracted_reqs=noop, stats=NS()),
        kv_events_publisher=NS(publish_kv_events=noop), publish_load_snapshot=noop,
        output_streamer=NS(stream_output=noop), dp_attn_adapter=NS(maybe_prepare_mlp_sync_batch=same),
        load_inquirer=NS(_get_num_pending_tokens=lambda **kwargs: 0),
        ps=NS(**ranks),
    )
    # the Scheduler's own mixin methods that only report: metrics, health checks, sleeping (0.5.12)
    for name in SCHEDULER_REPORTERS:
        state[name] = noop
    state["_get_num_pending_tokens"] = lambda **kwargs: 0
    return state


def session_state(tree) -> dict:
    """What ``init_running_status`` leaves on the Scheduler for its sessions: a ``SessionController`` over the tree
    (0.5.10 on), or 0.5.9's dict of sessions by id."""
    if has_private("session_controller"):
        return {"session_controller": private("session_controller")(tree)}
    return {"sessions": {}}


def closed_sessions_deferred(server) -> list[str]:
    """The streaming sessions whose close the server deferred and still holds (``close_on_finish``: 0.5.11 on), by
    id, for a turn it counts in flight (``_inflight``, sglang#31765) or for a last turn (``req_nodes``) that is not
    finished (a queued turn of a hybrid-mamba model aborted after its slot was restored: the abort's
    ``release_kv_cache`` commits it as the session's last turn, sglang#31765's second variant); none on a release
    without sessions or that deferral."""
    controller = vars(server).get("session_controller")
    sessions = vars(controller).get("sessions", {}) if controller is not None else {}
    return sorted(sid for sid, session in sessions.items() if vars(session).get("close_on_finish") and (
        vars(session).get("_inflight")
        or not all(node.req.finished() for node in (vars(session).get("req_nodes") or {}).values())))


def session_opened(output) -> bool:
    """Whether the Scheduler's answer to an ``OpenSessionReqInput`` opened the session (``success``: an id it still
    holds, or a capacity it refuses, is answered False)."""
    return bool(output.success)


def has_streaming_sessions() -> bool:
    """Whether the release's ServerArgs has ``--enable-streaming-session`` (0.5.10 on; 0.5.9 keeps no sessions)."""
    return has_private("streaming_session_flag")


def idle_method(scheduler_cls) -> str | None:
    """The first of :data:`IDLE_METHODS` the release's Scheduler has, or None."""
    return next((name for name in IDLE_METHODS if callable(getattr(scheduler_cls, name, None))), None)


def idle_question(scheduler_cls) -> str | None:
    """The first of :data:`IDLE_QUESTIONS` the release's Scheduler has, or None."""
    return next((name for name in IDLE_QUESTIONS if callable(getattr(scheduler_cls, name, None))), None)


def idle_lacking(scheduler_cls) -> list[str]:
    """What an idle step of the global loop needs and the release's Scheduler lacks: one of :data:`IDLE_METHODS`, one
    of :data:`IDLE_QUESTIONS`."""
    return [" or ".join(names) for names, have in ((IDLE_METHODS, idle_method(scheduler_cls)),
                                                   (IDLE_QUESTIONS, idle_question(scheduler_cls))) if have is None]


def fully_idle(server) -> bool:
    """Whether the Scheduler says it runs nothing, in the words of :func:`idle_question` (the driver asks once every
    request is answered, so no request waits either)."""
    return getattr(server, idle_question(type(server)))()


def check_idle_leaks(checker, stats) -> None:
    """A strict idle server's pool and request-row leak checks (raising where one fails): ``_check_all_pools`` over
    the pool stats and ``_check_req_pool`` (0.5.11 on), or ``check_memory`` (0.5.9, 0.5.10, which counts the pools
    itself and then checks the rows); the tree's sanity check is the caller's."""
    if callable(getattr(checker, "_check_all_pools", None)):
        has_leak, messages = checker._check_all_pools(stats())
        if has_leak:
            checker._report_leak("pool", "\n".join(messages))
        checker._check_req_pool()
    else:
        checker.check_memory()


def tree_sanity_check(checker) -> None:
    """The idle server's own tree check: ``_check_tree_cache`` (0.5.11 on), ``check_tree_cache`` before."""
    (getattr(checker, "_check_tree_cache", None) or checker.check_tree_cache)()


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
    (0.5.20 on), else (0.5.18 and the global-ServerArgs releases, ranks off the Scheduler's ``ps``) ``parallel_state``'s
    global where none is set."""
    import importlib
    from types import SimpleNamespace

    group = SimpleNamespace(cpu_group=cpu_group, rank_in_group=0, world_size=1)
    try:
        parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel()
    except (ImportError, AttributeError):  # no runtime context (0.5.12), or one without ranks to override
        parallel = None
    if hasattr(type(parallel), "override_permanently"):
        parallel.override_permanently(attn_tp_group=group, pp_rank=0, dp_rank=None, attn_tp_rank=0)
        return
    from sglang.srt.distributed import parallel_state

    if getattr(parallel_state, "_ATTN_TP", None) is None:
        parallel_state._ATTN_TP = group


def receiver_metadata_method(receiver) -> str:
    """The first of :data:`RECEIVER_METADATA_METHODS` the decode side's KV receiver has."""
    return next(name for name in RECEIVER_METADATA_METHODS if callable(getattr(receiver, name, None)))


@contextmanager
def transfer_args_kept():
    """For the span of building the decode queues: the fake transfer backend's KV manager keeps the ``KVArgs`` it is
    given (0.5.12 on it keeps them itself; 0.5.9/0.5.10's drops them), so the prefill stand-in reads the state kind
    SGLang chose for the pool (``KVArgs.state_type``) instead of working it out."""
    from unittest import mock

    from sglang.srt.disaggregation.fake.conn import FakeKVManager

    init = FakeKVManager.__init__

    def keeping(self, args, *rest, **kwargs):
        init(self, args, *rest, **kwargs)
        vars(self).setdefault("kv_args", args)

    with mock.patch.object(FakeKVManager, "__init__", keeping):
        yield


def typed_state_items(kv_manager, state_indices) -> dict:
    """The state items a decode server names beside a request's pages, by type name (``MAMBA``, ``SWA``, ``NSA``), as
    its KV manager's ``KVArgs`` type them: a list zipped with ``state_types`` (0.5.12 on), or the one item of
    ``state_type`` (0.5.9, 0.5.10; see :func:`transfer_args_kept`)."""
    kv_args = kv_manager.kv_args
    if "state_types" in vars(kv_args):
        names = [t.name for t in kv_args.state_types or []]
        return {name: items for name, items in zip(names, state_indices or []) if items is not None}
    return {} if state_indices is None else {kv_args.state_type.upper(): state_indices}


def decode_names_one_state_item() -> bool:
    """Whether the release's PD transfer arguments carry one ``state_type`` (0.5.9, 0.5.10: the decode side names one
    state item per request, chosen by its KV pool's kind) rather than a list of ``state_types`` (0.5.12 on)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    fields = vars(KVArgs).get("__annotations__", {})
    return "state_type" in fields and "state_types" not in fields
