"""The scheduler path on releases that keep one global ``ServerArgs`` (0.5.9 to 0.5.15; ``scheduling_global.py``)."""

from __future__ import annotations

from functools import lru_cache

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


def session_state(tree) -> dict:
    """What ``init_running_status`` leaves on the Scheduler for its sessions: a ``SessionController`` over the tree
    (0.5.10 on), or 0.5.9's dict of sessions by id."""
    if has_private("session_controller"):
        return {"session_controller": private("session_controller")(tree)}
    return {"sessions": {}}


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
