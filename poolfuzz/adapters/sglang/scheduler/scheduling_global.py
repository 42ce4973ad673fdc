"""SGLang's Scheduler on releases whose server arguments are one process global (0.5.9 to 0.5.15): built and stepped.

``scheduling.py`` drives the Scheduler the same way on every release; what differs before 0.5.23's runtime context
is here (every engine-private name it reads is in ``compat``):

* The server's arguments: ``ServerArgs`` of the path's flags, published with ``set_global_server_args_for_scheduler``
  as ``Scheduler.__init__`` publishes them, with the micro-batch size ``init_model_worker`` derives. The model path
  is ``dummy``, SGLang's own name for a server without weights (its model-dependent validation is skipped).
* The prefix tree: the release's own choice, made by the code the Scheduler runs (0.5.13 on: its registry's
  ``create_tree_cache``, which wraps the cache in a ``StreamingSession`` where ``--enable-streaming-session`` asks;
  0.5.9 to 0.5.12: ``Scheduler.init_cache_with_memory_pool`` itself, run on the server with a ``TpModelWorker`` stand-in
  that hands it the family's pools and says what kind of model it serves); with ``--enable-hierarchical-cache`` (the
  HiCache server) its host tier, on ``hicache``'s CPU stand-ins, the worker taking the load-back layer counter.
* The event loop: ``get_next_batch_to_run()`` on the Scheduler's own state, ``process_batch_result`` (0.5.13 hands
  it to its ``SchedulerBatchResultProcessor``, built by the Scheduler's ``init_batch_result_processor``; 0.5.12
  runs its output-processor mixin), and an idle step's ``on_idle`` (a strict server's pool and request-row leak
  checks, the tree's sanity check, the new-token ratio reset), as ``event_loop_normal`` runs them; after each
  step the strict busy check (``self_check_during_busy``; 0.5.12's is a mixin method, 0.5.13's a component's). An
  idle step's housekeeping is ``self_check_during_idle`` on 0.5.9 and 0.5.10, and 0.5.9 keeps no streaming sessions
  (no ``--enable-streaming-session``).
* ``run_batch``: the model-runner stand-in forwards; the sampled ids become ``batch.output_ids`` as ``run_batch``
  sets them (0.5.12's ``prepare_for_decode`` feeds them to the next decode).

Stood in for, as on 0.5.23: the TpModelWorker (its sizes are the family's pools), the tokenizer's and detokenizer's
sockets (what the server sends them is recorded), metrics and their timers (no-ops).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

from poolfuzz.adapters.sglang import compat
from poolfuzz.adapters.sglang.compat.drift import marked_stand_in
from poolfuzz.adapters.sglang.host_tier import hicache
from poolfuzz.adapters.sglang.scheduler.model_facts import (empty_batch, max_req_len, model_config_standin,
                                                            tokens_per_layer, worker_max_running)
from poolfuzz.adapters.sglang.server_args import NO_MODEL
from poolfuzz.adapters.sglang.tree.tree_build import runner_mamba_ratio, with_mamba_ratio
from poolfuzz.pools.errors import ConfigError



def build_server(driver, config, max_running: int) -> "GlobalLoop":
    """``driver``'s server on a global-ServerArgs release: its flags published (``driver.server_args``, with
    ``--enable-streaming-session`` where the release has it), its pools (``driver.build_family``), what the server
    resolves on them (``driver.pools_built``), a Scheduler of ``driver.role`` over the tree the release builds, and its
    own ``init_*`` methods; sets ``driver.config``, ``family``, ``tree``, ``server`` and ``total``, and returns the
    event loop."""
    m = driver.m
    # --enable-streaming-session: 0.5.10 on, on a server that takes sessions' turns itself (not a PD decode server)
    driver.streaming_sessions = driver.takes_sessions and compat.has_streaming_sessions()
    if driver.streaming_sessions:
        driver.server_args = dict(driver.server_args, enable_streaming_session=True)
    try:
        server_args = publish(driver.server_args, max_running_requests=max_running)
    except (AssertionError, ValueError) as exc:  # ServerArgs' own validation: no server starts with these
        raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: SGLang refuses a "
                          f"server with {driver.server_args} ({exc})") from None
    if config.has_mamba and not compat.has_private("runner_mamba_ratio"):
        config, family = inline_mamba_sized(config, lambda trial: driver.build_family(trial, max_running),
                                            server=repr(sorted(driver.server_args.items())))
    else:
        config, family = mamba_sized(config, server_args), None
    driver.config = config
    driver.family = family if family is not None else driver.build_family(config, max_running)
    driver.pools_built()
    driver.total, capacity = compat.worker_token_capacity(driver.family)
    server = driver.server = marked_stand_in(object.__new__(m.Scheduler))  # a field it lacks and SGLang reads: drift
    server.__dict__.update(compat.global_scheduler_state(
        server_args=server_args, model_config=model_config_standin(config), spec_algorithm=m.SpeculativeAlgorithm.NONE,
        disaggregation_mode=getattr(m.DisaggregationMode, driver.role), config=config, total=driver.total,
        max_running=worker_max_running(driver.family), max_req_len=max_req_len(config, capacity), sent=driver._sent))
    try:
        driver.tree = build_tree(server, driver.family, server_args)
    except (AssertionError, ValueError) as exc:  # the tree's (or its host tier's) own refusal
        raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: SGLang's radix "
                          f"cache refuses a server with {driver.server_args} ({exc})") from None
    full_tokens, swa_tokens = tokens_per_layer(driver.family)
    server.__dict__.update(tree_cache=driver.tree, req_to_token_pool=driver.family.sg_req_pool,
                           token_to_kv_pool_allocator=driver.family.sg_allocator, is_hybrid_swa=config.has_swa,
                           is_hybrid_ssm=config.has_mamba,
                           sliding_window_size=config.sliding_window if config.has_swa else None,
                           full_tokens_per_layer=full_tokens, swa_tokens_per_layer=swa_tokens,
                           disable_radix_cache=server_args.disable_radix_cache, running_batch=empty_batch())
    finish_building(server)
    return GlobalLoop(server)


def publish(flags: dict, *, max_running_requests: int):
    """The server's ``ServerArgs`` with ``flags`` (the rest at their defaults), published as the Scheduler's global,
    with the micro-batch size ``Scheduler.init_model_worker`` derives and the model's ``mamba_chunk_size`` (in
    ``flags``, where the model has one) pre-seeded where the release reads it from a model config (0.5.13; 0.5.12's
    grid is FLA's chunk or the page, whatever is given)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    flags = dict(flags)
    mamba_chunk_size = flags.pop("mamba_chunk_size", 64)
    server_args = ServerArgs(model_path=NO_MODEL, device="cpu", **compat.server_flags(ServerArgs, flags))
    server_args.pp_max_micro_batch_size = max(max_running_requests // server_args.pp_size, 1)
    compat.seed_mamba_chunk_size(server_args, max(mamba_chunk_size, flags.get("page_size", 1)))
    set_global_server_args_for_scheduler(server_args)
    compat.single_tensor_parallel_rank()
    return server_args


def mamba_sized(config, server_args):
    """Mamba slots as the release's model runner sizes them for the server (``_calculate_mamba_ratio``, run on a
    runner stand-in holding the server's arguments: a state, a checkpoint and a copy-on-write a request, plus the
    extra buffer's track slots) times the request rows, where the config has fewer: rows beyond the state slots a
    server keeps run its mamba pool dry (``Can not alloc mamba cache``), which no server of those flags does. A
    release without that method (0.5.9) is sized by :func:`inline_mamba_sized`."""
    if not config.has_mamba:
        return config
    return with_mamba_ratio(config, runner_mamba_ratio(server_args))


# The most state slots a request row is tried with before the server is refused (0.5.9's runner keeps a row for
# every three slots, four with the extra buffer).
MAX_SLOTS_PER_ROW = 16
_INLINE_SLOTS: dict = {}  # (config, server) -> the state slots found: a process (one release) searches once per server


def inline_mamba_sized(config, build, *, server: str):
    """``config`` with the fewest mamba slots (at least its own) at which the release's model runner keeps its request
    rows, and the family ``build(config)`` built there. 0.5.9 has no ``_calculate_mamba_ratio`` to ask: its
    ``init_memory_pool`` sizes the rows inline from ``--max-mamba-cache-size`` (a third of it, a quarter with the extra
    buffer, all of it without a radix cache), so the slots are found by building the server's pools, each try decided
    by the runner's own code: doubled until the rows are kept, then bisected down to the fewest. ``server``: the
    server's flags, as the key the slots found are kept under."""
    rows, key = config.request_rows, (config, server)
    if key in _INLINE_SLOTS:
        sized = config.replace(mamba_slots=_INLINE_SLOTS[key])
        return sized, build(sized)

    def kept(slots: int):
        family = build(config.replace(mamba_slots=slots))
        return family if family.sg_req_pool.size >= rows else None

    short, slots = config.mamba_slots - 1, config.mamba_slots  # short: the most slots known to keep too few rows
    while (family := kept(slots)) is None:
        if slots >= MAX_SLOTS_PER_ROW * rows:
            from poolfuzz.adapters.sglang.api import load

            raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: SGLang "
                              f"{load().version}'s model runner keeps fewer than {rows} request rows with {slots} "
                              f"mamba state slots (init_memory_pool sizes them inline)")
        short, slots = slots, slots * 2
    while slots - short > 1:
        middle = (short + slots) // 2
        if (fewer := kept(middle)) is None:
            short = middle
        else:
            slots, family = middle, fewer
    _INLINE_SLOTS[key] = slots
    return config.replace(mamba_slots=slots), family


def build_tree(server, family, server_args):
    """The prefix tree the release's Scheduler builds over the family's pools (see the module); with
    ``--enable-hierarchical-cache`` its host tier too, on the CPU stand-ins of ``hicache.install_cpu_host_tier``, the
    TP worker stand-in taking the load-back layer counter (``hicache.worker_standin``)."""
    hierarchical = server_args.enable_hierarchical_cache
    if hierarchical:
        hicache.install_cpu_host_tier()
    tree = _release_tree(server, family, server_args)
    if hierarchical:
        hicache.register_kernel_buffers(tree)
    return tree


def _release_tree(server, family, server_args):
    c = family.config
    if compat.has_tree_registry():
        from sglang.srt.mem_cache import registry
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = CacheInitParams(disable=False, req_to_token_pool=family.sg_req_pool,
                                 token_to_kv_pool_allocator=family.sg_allocator, page_size=c.page_size,
                                 enable_mamba_extra_buffer=server_args.enable_mamba_extra_buffer(),
                                 chunked_prefill_size=server_args.chunked_prefill_size,
                                 sliding_window_size=c.sliding_window if c.has_swa else None)
        # the worker's full-attention tokens, by which the registry tells an all-SWA model (0: PureSWARadixCache,
        # 0.5.15 on) from a hybrid one
        fields = getattr(registry.TreeCacheBuildContext, "__dataclass_fields__", {})
        full = {"full_tokens_per_layer": c.full_tokens} if "full_tokens_per_layer" in fields else {}
        return registry.create_tree_cache(registry.TreeCacheBuildContext(
            server_args=server_args, params=params, is_hybrid_swa=c.has_swa, is_hybrid_ssm=c.has_mamba,
            enable_hierarchical_cache=server_args.enable_hierarchical_cache,
            disable_radix_cache=server_args.disable_radix_cache,
            effective_chunked_prefill_size=server_args.chunked_prefill_size, tp_worker=hicache.worker_standin(),
            model_config=None,
            tp_size=1, tp_rank=0, tp_group=None, **full))
    # 0.5.12: the Scheduler's own init_cache_with_memory_pool, over a worker that serves this model's pools
    compat.resolved_to_sglangs_own_model(server.model_config)
    server.__dict__.update(tp_worker=_worker(family), server_args=server_args)
    server.init_cache_with_memory_pool()
    return server.tree_cache


def _worker(family):
    """What ``init_cache_with_memory_pool`` asks the TpModelWorker: the model's kind and its pools."""
    c = family.config
    runner = NS(linear_attn_model_spec=None, hybrid_gdn_config=NS() if c.has_mamba else None, mamba2_config=None,
                prefill_aware_swa=False)
    return hicache.worker_standin(
        is_hybrid_swa=c.has_swa, model_runner=runner, sliding_window_size=c.sliding_window,
        get_tokens_per_layer_info=lambda: (c.full_tokens, c.swa_tokens),
        get_memory_pool=lambda: (family.sg_req_pool, family.sg_allocator))


def finish_building(server) -> None:
    """The Scheduler's own ``init_*`` methods that build what its event loop reads over the tree, where the release
    has them (``compat.SCHEDULER_INITS``: the chunk size, where one <= 0 is no chunking; the policy and new-token
    ratio; the pool stats observer; the invariant checker; the batch result processor), and
    ``init_running_status``'s session state."""
    server.__dict__.update(compat.session_state(server.tree_cache))
    compat.resolved_to_sglangs_own_model(server.model_config)  # init_chunked_prefill asks (0.5.14 on)
    for init in compat.scheduler_inits(type(server)):
        getattr(server, init)()


class GlobalLoop:
    """One step of a global-ServerArgs release's ``event_loop_normal`` over a built server (see the module)."""

    def __init__(self, server):
        self.server = server
        self.housekeeping = getattr(server, compat.idle_method(type(server)))  # on_idle, or 0.5.9/0.5.10's name

    def next_batch(self):
        s = self.server
        s.num_retracted_reqs = 0
        compat.retractions_reset(s)
        batch = s.get_next_batch_to_run()
        s.cur_batch = batch
        return batch

    def retractions(self) -> int:
        return compat.retractions_counted(self.server)

    def finish(self, batch, result) -> None:
        batch.output_ids = result.next_token_ids  # run_batch's relay of the sampled ids to the next decode
        self.server.process_batch_result(batch, result)
        self.server.last_batch = batch

    def run_placeholder(self, batch) -> None:
        """``run_batch`` on a PD decode server's prebuilt batch, where the plan returns it as a batch to run (0.5.9):
        its ``_run_batch_prebuilt`` (no forward), the result processed, the batch the last one (the next plan merges
        it into the running batch)."""
        s = self.server
        s.process_batch_result(batch, s._run_batch_prebuilt(batch))
        s.last_batch = batch

    def idle(self) -> None:
        from sglang.srt.environ import envs

        s = self.server
        with envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(True):
            self.housekeeping()
        s.last_batch = None
