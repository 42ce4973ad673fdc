"""SGLang's own batch scheduling on the CPU, over the family's pools and radix tree, fed by a model-runner stand-in.

What runs is SGLang's as shipped (issue 31): ``Scheduler.get_next_batch_to_run`` (the chunked request stashed into
the tree, the last prefill batch filtered and merged into the running batch), ``get_new_batch_prefill``
(``SchedulePolicy.calc_priority``, the tree match of ``Req.init_next_round_input``, ``PrefillAdder``'s token and
memory budgets and its chunking, ``ScheduleBatch.init_new`` and ``prepare_for_extend``), ``update_running_batch``
(``check_decode_mem``, ``retract_decode`` under memory pressure and the retracted requests re-queued,
``prepare_for_decode``), ``abort_request``, and ``SchedulerBatchResultProcessor`` (outputs appended, finish checks,
``release_kv_cache`` / ``checkpoint_kv_cache`` into the tree). Nothing here decides what the scheduler decides:
which requests are batched, how far a chunk goes, which slots they get and who is retracted come from SGLang.

What is stood in for, and why:

* ``Scheduler.__init__``: it builds a TpModelWorker, which loads a model on a GPU. The server is a ``Scheduler``
  made without it (``object.__new__``) and given the state its ``__init__`` leaves on a server with default flags
  and a radix cache (``compat.scheduler_state``); its own methods then run unchanged. Its sizes are the
  TpModelWorker's (``get_worker_info``): ``max_req_input_len`` is ``min(context, pool) - 1 - 5``.
* ``Scheduler.run_batch``: its model forward is :class:`~poolfuzz.adapters.sglang.scheduler.runner.ModelRunner`; its
  counters (``forward_ct``, ``processed_tokens_counter``) are kept as it keeps them.
* ``Scheduler.handle_generate_request`` (it takes a tokenized request off a ZMQ socket): its admission of a
  request, ``init_req_max_new_tokens`` (max_new_tokens clipped to what the server holds) and
  ``validate_input_length`` (a refused prompt is queued finished with an abort), then ``_add_request_to_queue``.

Checked: before every forward, the runner's contents and token checks (``runner.py``); after every rule, SGLang's
own ``SchedulerInvariantChecker`` as a server run with its strict memory checks runs it after a batch (exact slot
conservation, no page owned and free, none free twice), and at the end, idle, ``on_idle``'s leak checks and the
tree's ``sanity_check`` (``compat.engine_invariant_problem``).

The server's arguments are published as a launcher publishes them (``server_args.publish_server_args``:
``ServerArgs`` of the flags of :func:`server_arguments`, with what SGLang derives from them), so the Scheduler, the
tree and ``ScheduleBatch`` read one server's configuration. A model with recurrent state runs the mamba radix cache
with the strategy its pools were built for (``no_buffer``, or ``extra_buffer`` with its track slots), a model
``mamba_chunk_size`` of 4 and ``--mamba-track-interval 8``, so short prompts cross the boundaries where states are
checkpointed; its mamba slots are sized by SGLang's configurator (``mamba_sized``). A combination the server refuses
(SGLang's tree asserts it at construction) is declined with SGLang's message.

The loop is ``event_loop_normal``, the one a CPU server runs, i.e. a server with ``--disable-overlap-schedule``; a
GPU server runs ``event_loop_overlap`` by default (results a step late, a ping-pong pair of track slots), not driven
here. Driven: every KV layout the family builds (MHA K and V, MLA's latent and rope parts, FP8 and FP4 bytes with
their scale rows, MiniMax's and DSA's index caches) in models of full-attention, sliding-window and mamba layers, on
one-token and paged pools (the Scheduler's ``sliding_window_size`` and per-side token counts are the pools'), and
speculative decoding through ``run_batch`` (``spec_worker.py``, where ``speculative_problem`` allows); on releases
whose Scheduler and result processor this module builds (``release_problem``). Servers with other flags: ``servers.py``.
"""

from __future__ import annotations

import contextlib
import logging
from functools import lru_cache
from unittest import mock

import torch

from poolfuzz.adapters.sglang import compat
from poolfuzz.adapters.sglang.compat.drift import drift_checked, marked_stand_in
from poolfuzz.adapters.sglang.host_tier import l3
from poolfuzz.adapters.sglang.pools.family import build_sglang_family
from poolfuzz.adapters.sglang.scheduler.backups import unalias_backup
from poolfuzz.adapters.sglang.shims import cpu_server, root_warnings_off
from poolfuzz.adapters.sglang.scheduler.runner import ModelRunner, RowGuard, deferred_cow_and_clear
from poolfuzz.adapters.sglang.scheduler.model_facts import (MAMBA_CHUNK, VOCAB, empty_batch, max_req_len,
                                                            model_config_standin, schedule_batch_class,
                                                            tokens_per_layer, worker_max_running)
from poolfuzz.adapters.sglang.scheduler.sessions import SessionClients
from poolfuzz.adapters.sglang.scheduler.spec_worker import SpecWorker, speculative_flags, speculative_problem
from poolfuzz.adapters.sglang.pools.environment import server_environment
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, ServerStuck
from poolfuzz.pools.token_chain import Tokens

DRAIN_STEPS = 400
# What the harness calls on a server (``harness.scheduled``'s driver surface): each re-raises the adapter's drift as
# API CHANGED (``compat.drift``), never as a crash found in SGLang.
DRIVER_CALLS = ("add_request", "session_turn", "close_session", "propose_drafts", "step", "abort", "flush",
                "state_problem", "drain", "close")
STALLED_STEPS = 3  # idle steps with requests waiting after which a session's client gives up its turn
# A model with recurrent state: --mamba-track-interval a multiple of its chunk (``model_facts.MAMBA_CHUNK``), so that
# prompts of a few dozen tokens cross track boundaries where the extra buffer snapshots a state for the radix tree (the
# defaults, 64 and 256, need 1000s).
MAMBA_TRACK_INTERVAL = 8


@lru_cache(maxsize=1)
def scheduler_modules():
    """SGLang's scheduler and what it hands its methods, imported once (after the pools' import shims)."""
    import types
    import warnings

    from poolfuzz.adapters.sglang.api import first_importable, load

    from poolfuzz.adapters.sglang.shims import import_module

    load()  # the CPU shims go in before any sglang import
    # ERROR too: a refused prompt is logged as an error by the server (Req.set_finish_with_abort), and is traffic
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    with warnings.catch_warnings():  # its import chain warns that Triton falls back to the CPU: not ours to fail on
        warnings.simplefilter("ignore")
        # 0.5.12's chain reaches sgl_kernel (the host pools): its stand-in goes in on demand
        module = import_module(compat.SCHEDULER_MODULE)
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.utils import GenerationBatchResult, validate_input_length
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(Scheduler=module.Scheduler, Req=Req, SchedulePolicy=SchedulePolicy,
                                 SamplingParams=SamplingParams, GenerationBatchResult=GenerationBatchResult,
                                 AbortReq=AbortReq, validate_input_length=validate_input_length,
                                 DisaggregationMode=DisaggregationMode, SpeculativeAlgorithm=SpeculativeAlgorithm,
                                 ResultProcessor=first_importable(compat.RESULT_PROCESSOR, required=False),
                                 TokenRatio=first_importable(compat.TOKEN_RATIO, required=False))


def release_problem() -> str | None:
    """Why this release's Scheduler cannot be driven here, or None."""
    from poolfuzz.adapters.sglang.api import first_importable, load

    api = load()
    try:
        m = scheduler_modules()
    except ImportError as exc:
        return f"SGLang's scheduler cannot be imported here ({exc}); ci/sglang-install.sh installs what it needs"
    context = compat.plans_with_context(m.Scheduler)
    if context:
        missing = [t for t in (compat.RESULT_PROCESSOR, compat.TOKEN_RATIO)
                   if first_importable(t, required=False) is None]
        if missing:
            return (f"SGLang {api.version} has no {' or '.join(missing)}: the scheduler path drives the event loop "
                    "of releases whose Scheduler hands results to those components (0.5.23)")
        methods = compat.SCHEDULER_METHODS
    else:
        methods = compat.GLOBAL_SCHEDULER_METHODS + (() if compat.has_tree_registry()
                                                     else ("init_cache_with_memory_pool",))
    lacking = [name for name in methods if not callable(getattr(m.Scheduler, name, None))]
    lacking += [] if context else compat.idle_lacking(m.Scheduler)
    if lacking:
        return f"SGLang {api.version}'s Scheduler has no {', '.join(lacking)}: the scheduler path calls them"
    return _server_arguments_problem(api.version) if context else None


@lru_cache(maxsize=1)
def _server_arguments_problem(version: str) -> str | None:
    """Whether this release publishes a server's default arguments without a model (its radix tree reads them)."""
    import os

    from poolfuzz.adapters.sglang.server_args import publish_defaults

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a release that wants a model's config fails at once, offline
    try:
        publish_defaults()
    except (OSError, ImportError) as exc:
        return (f"SGLang {version}'s server arguments cannot be published without a model "
                f"({str(exc).splitlines()[0][:80]}); the scheduler path drives releases that publish them so")
    except AttributeError as exc:  # a runtime context this path cannot publish into
        return (f"SGLang {version}'s runtime context cannot publish a server's arguments ({exc}); the scheduler path "
                "drives releases from 0.5.16 on, or those that keep one global "
                "ServerArgs (0.5.9 to 0.5.15)")
    return None


class SglangSchedulerDriver:
    """One example's server: SGLang's Scheduler methods and result processor, and the model-runner stand-in."""

    def __init__(self, config: ModelConfig, *, backup_mode: str | None = None):
        from poolfuzz.adapters.sglang.api import load

        self.named_backup = backup_mode  # the run's --backup-mode: None, or one of backup_modes
        reason = speculative_problem(config, type(self)) or release_problem()
        if reason:
            raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: {reason}")
        m = scheduler_modules()
        self.m = m
        config = self.sized(served(config))
        max_running = config.request_rows  # the server's --max-running-requests, the flag its pools are built with
        self.server_args = self.server_flags(config, max_running_requests=max_running)
        self.aborted: set[str] = set()  # requests the server answered with an abort (no longer its to run)
        self.streaming_sessions = False  # driven where it is built with --enable-streaming-session (0.5.10-0.5.15)
        self.session_clients = SessionClients(self)
        self.outcome: dict[str, str] = {}  # request id -> "finished" / "aborted", once the server is done with it
        from poolfuzz.adapters.sglang.pools.configurator import hooks_environment

        # as an operator starts it, with what SGLang's argument hooks set for its flags (configurator.hooks_environment)
        self.environment = hooks_environment(config, role_flags=self.pool_flags) | server_environment(config)
        with cpu_server(self.environment):  # the environment it runs in, while it builds and at every step
            if compat.plans_with_context(m.Scheduler):
                self._build_context_server(config, max_running)
            else:
                self._build_global_server(config, max_running)
        config = self.config
        # a server without a radix cache (a PD decode server's) makes no prefix hits: its cache needs no state
        if config.has_mamba and not self.tree.supports_mamba() and not self.server_args.get("disable_radix_cache"):
            raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: the prefix tree "
                              f"SGLang {load().version}'s Scheduler builds for this model ({type(self.tree).__name__}) "
                              "keeps no recurrent state: a prefix hit would give a request no state to resume, so this "
                              "release's radix cache is not one for models with both sliding-window and mamba layers")
        req_pool = self.family.sg_req_pool
        cow_and_clear, aligned_lens = deferred_cow_and_clear(req_pool), compat.mamba_track_aligned_lens(MAMBA_CHUNK)
        lacking = [name for name, missing in (
            ("a deferred mamba copy-on-write (ModelRunner._maybe_execute_deferred_mamba_cow_and_clear)",
             cow_and_clear is None and compat.batches_defer_mamba_cow(schedule_batch_class())),
            ("ForwardBatch.mamba_track_aligned_lens or MambaAttnBackendBase._init_track_ssm_indices",
             aligned_lens is None)) if missing]
        if config.has_mamba and lacking:
            raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: SGLang "
                              f"{load().version} has no {' or '.join(lacking)}, which the model-runner stand-in "
                              "calls for a model with recurrent state")
        self.runner = ModelRunner(family=self.family, vocab=VOCAB, cow_and_clear=cow_and_clear,
                                  aligned_lens=aligned_lens)
        self.spec_worker = SpecWorker.attached(self, vocab=VOCAB) if config.spec_draft_tokens else None  # run_batch's
        self.requests: dict[str, object] = {}  # rid -> SGLang's Req, until it finishes
        self.next_rid, self.fresh = 1, VOCAB  # the next request id; the next prompt token (above the sampled ones)
        self.retracted = 0  # requests retract_decode took back (each is recomputed and checked again)
        self.first_prefix: dict[str, int] = {}  # rid -> the prefix the tree matched for its first batch
        self.chunked = 0  # prefill forwards of a chunk that was not a prompt's last
        self.refused = 0

    # The server's role: NULL, a server that prefills and decodes (decode_server.py's is a PD decode server).
    role = "NULL"
    label = "the sglang scheduler path"  # what the family's messages call it
    family_name = "sglang:scheduler"  # the --family that runs it (the listing a decline of its pools names)
    retraction = "recomputes retracted requests"  # what it does with one (the backup modes it drives: cpu_tensor)
    backup_modes: tuple[str, ...] = ("cpu_tensor",)  # the --backup-mode values it takes
    backup_mode = "cpu_tensor"  # the retraction path an artifact records (this server recomputes, on tensors)
    resolves_on_pools = False  # whether it resolves server flags on its built pools (pools_built)
    # started with --enable-hierarchical-cache (hicache_server.py) / --enable-unified-memory (unified_server.py)
    hierarchical = unified = False
    drives_speculative = True  # whether it drives a speculative config (spec_worker.py)
    takes_sessions = True  # whether it is started with --enable-streaming-session where the release has it
    storage_dir: str | None = None  # its L3 tier's directory (--hicache-storage-backend, hicache_server.py), or None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        drift_checked(cls, DRIVER_CALLS)  # a server's own overrides (hicache's abort) too

    def server_flags(self, config: ModelConfig, *, max_running_requests: int) -> dict:
        return server_arguments(config, max_running_requests=max_running_requests)

    @property
    def pools_origin(self):
        """Who built the pools this server runs on: SGLang's configurator (or its model runner) for its flags."""
        return self.family.pools_origin

    def build_family(self, config: ModelConfig, max_running: int):
        """The family over the pools SGLang's configurator builds for this server's flags."""
        return build_sglang_family(config, listing=self.family_name)

    pool_flags: dict | None = None  # the role flags its pools are built with beside the config's (build_family)

    def sized(self, config: ModelConfig) -> ModelConfig:
        """The config as this server's pools are sized where SGLang sizes them itself (``configurator.server_sized``:
        a server sized by its memory; a role's window pool), so that its caps, its family and its checks are the
        server's."""
        from poolfuzz.adapters.sglang.pools.configurator import server_sized

        return server_sized(config, role_flags=self.pool_flags)

    def pools_built(self):
        """What a server resolves once its pools exist and before its tree is built; the TP worker stand-in the tree
        is built with, or None (this server's tree needs none)."""
        return None

    def _build_context_server(self, config: ModelConfig, max_running: int) -> None:
        """0.5.23's server: its arguments in the runtime context, the tree its registry picks, its components."""
        from poolfuzz.adapters.sglang.server_args import publish_server_args
        from poolfuzz.adapters.sglang.tree.tree_build import build_tree, mamba_sized

        m = self.m
        # before the configurator's sizing reads them; afresh, where this server resolves flags on its own pools
        publish_server_args(fresh=self.resolves_on_pools, **self.server_args)
        config = mamba_sized(config)
        self.config = config
        self.family = self.build_family(config, max_running)
        self.row_guard = RowGuard(self.family.sg_req_pool)  # before the tree, runner or future map hold req_to_token
        worker = self.pools_built()
        try:
            self.tree = build_tree(self.family, hierarchical=self.hierarchical, server=self.server_args,
                                   worker=worker, storage_dir=self.storage_dir)
        except (AssertionError, ValueError, NotImplementedError) as exc:  # the tree's build refuses the server's flags
            raise ConfigError(f"the scheduler-driven sglang family cannot build {config.name!r}: SGLang's radix "
                              f"cache refuses a server with {self.server_args} ({exc})") from None
        req_pool, allocator = self.family.sg_req_pool, self.family.sg_allocator
        self.total, capacity = compat.worker_token_capacity(self.family)  # the TP worker's report to its scheduler
        model = model_config_standin(config)
        pd = getattr(m.DisaggregationMode, self.role)
        processor = compat.result_processor(m.ResultProcessor, tree=self.tree, req_to_token_pool=req_pool,
                                            allocator=allocator, model_config=model, disaggregation_mode=pd)
        max_running = worker_max_running(self.family)
        flags = compat.publish_scheduler_context(max_running_requests=max_running)
        longest = max_req_len(config, capacity)
        self.server = marked_stand_in(object.__new__(m.Scheduler))  # a field SGLang reads and it lacks: drift
        self.server.__dict__.update(compat.scheduler_state(
            tree=self.tree, req_to_token_pool=req_pool, allocator=allocator, model_config=model,
            spec_algorithm=m.SpeculativeAlgorithm.from_string(self.server_args.get("speculative_algorithm")),
            disaggregation_mode=pd, flags=flags,
            page_size=config.page_size, is_hybrid_ssm=config.has_mamba,
            sliding_window_size=config.sliding_window if config.has_swa else None,
            swa_tokens=tokens_per_layer(self.family),
            max_running_requests=max_running, max_total_num_tokens=self.total,
            max_req_len=longest, max_req_input_len=longest - 5,
            policy=m.SchedulePolicy(flags["schedule_policy"], self.tree, False, False, False),
            token_ratio=compat.token_ratio(m.TokenRatio),
            processor=processor, enable_hierarchical_cache=self.hierarchical,
            enable_hicache_storage=l3.enabled(self.tree), enable_unified_memory=self.unified))
        compat.init_chunked_prefill(self.server)
        self.server.running_batch = empty_batch()
        self.server.init_pool_stats_observer()  # the Scheduler's own, for SGLang's invariant checker below
        self.server.init_invariant_checker()
        # what the tokenizer manager would be told (0.5.23: send_abort_output; 0.5.18: its IPC channel)
        self.server.send_abort_output = self._abort_sent
        self.server.ipc_channels.send_to_tokenizer.send_output = self._sent
        self.loop = ContextLoop(self.server, processor)

    def _build_global_server(self, config: ModelConfig, max_running: int) -> None:
        """A 0.5.9-0.5.15 server: one global ServerArgs, the tree its Scheduler builds (``scheduling_global``)."""
        from poolfuzz.adapters.sglang.scheduler import scheduling_global as legacy

        self.loop = legacy.build_server(self, config, max_running)

    def _sent(self, output, req=None) -> None:
        """What the server sends the tokenizer manager: an abort answers a request (it is no longer the server's)."""
        for rid in getattr(output, "rids", None) or [getattr(output, "rid", None)]:
            if rid is not None and type(output).__name__.startswith("Abort"):
                self.aborted.add(rid)

    @property
    def hits(self) -> int:
        """Requests that joined their first batch with a prefix matched in the tree."""
        return sum(1 for prefix in self.first_prefix.values() if prefix)

    # --- traffic ---------------------------------------------------------------------------------
    def live(self) -> list[str]:
        return sorted((rid for rid, req in self.requests.items() if not req.finished()), key=int)

    def add_request(self, *, length: int, share: int, max_tokens: int, priority: int = 0) -> str:
        """A request of ``length`` new tokens after, where ``share`` > 0, up to ``share`` * 4 tokens (pages, where a page
        is longer) of an earlier request's (its prompt and outputs); ``priority`` is ignored (the server schedules
        without priorities)."""
        ids: list[int] = []
        known = sorted(self.runner.tokens, key=int)
        if share and known:
            src = self.runner.tokens[known[share % len(known)]].ids
            ids = list(src[:min(len(src), share * max(4, self.config.page_size))])
        ids += list(range(self.fresh, self.fresh + length))
        self.fresh += length
        rid = f"{self.next_rid:06d}"  # SGLang aborts every request whose id starts with the one named
        params = self.m.SamplingParams(max_new_tokens=max_tokens)
        params.normalize(None)
        req = compat.new_request(self.m.Req, rid=rid, ids=ids, sampling_params=params, vocab_size=VOCAB)
        self.next_rid += 1
        self.runner.tokens[rid] = Tokens(ids=list(ids))
        self.requests[rid] = req
        # handle_generate_request's admission: max_new_tokens clipped to what the server holds (a release whose
        # allocator answers that the prompt cannot fit at all aborts it there), the prompt checked against
        # max_req_input_len (a refused request is queued finished with an abort, as the server queues it)
        self.server.init_req_max_new_tokens(req)
        refusal = self.m.validate_input_length(req, self.server.max_req_input_len, False)
        if refusal:
            req.set_finish_with_abort(refusal)
        if req.to_finish is not None:  # refused by either: its prompt becomes one token, prefilled once to
            self.refused += 1  # answer the abort
            self.runner.tokens[rid] = Tokens(ids=list(req.origin_input_ids))
        self._queue(req)
        return rid

    def _queue(self, req) -> None:
        compat.queue_request(self.server, req)

    def session_turn(self, *, session: int, length: int, max_tokens: int) -> str | None:
        """The next turn of streaming session ``session`` (``sessions.SessionClients.turn``)."""
        return self.session_clients.turn(f"session-{session}", length=length, max_tokens=max_tokens)

    def close_session(self, session: int) -> None:
        """The client closes streaming session ``session``, where it is open and its last turn answered."""
        self.session_clients.close(f"session-{session}", give_up=False)

    def propose_drafts(self, tokens: int) -> None:
        """The drafter drafts a tree of ``speculative_num_draft_tokens - 1`` nodes every round, whatever is asked."""

    @property
    def speculative(self) -> bool:
        return self.spec_worker is not None

    def step(self) -> None:
        """One iteration of ``Scheduler.event_loop_normal``: the next batch, its forward, its result."""
        with cpu_server(self.environment), backups_own_memory(self.family):
            self._step()

    def _step(self) -> None:
        s = self.server
        batch = self.loop.next_batch()
        self.retracted += self.loop.retractions()
        if batch is None:
            try:
                self.loop.idle()
            except ValueError as exc:  # on_idle's strict leak check: the server stops here
                raise AssertionError(str(exc).strip() + self.session_clients.told()) from None
            self._forget_done()  # a chunked request's deferred abort is answered at the top of a step
            return
        if batch.forward_mode.is_prebuilt():  # a PD decode server's transferred requests, planned alone (0.5.9)
            self.loop.run_placeholder(batch)
            return self._forget_done()
        if batch.forward_mode.is_extend():
            for r, p in zip(batch.reqs, batch.prefix_lens):
                self.first_prefix.setdefault(r.rid, p)  # its first batch: what the tree matched
            self.chunked += sum(1 for r in batch.reqs if r is s.chunked_req)
        if self.spec_worker is not None:  # run_batch's own spec-v2 branch (and counters), around the worker stand-in
            self.loop.finish(batch, s.run_batch(batch), counted=True)
            return self._forget_done()
        s.forward_ct += 1  # run_batch's counter
        batch.forward_iter = s.forward_ct
        tokens = self.runner.forward(batch)
        self.loop.finish(batch, self.m.GenerationBatchResult(next_token_ids=torch.tensor(tokens, dtype=torch.int64)))
        self._forget_done()

    def abort(self, rid: str) -> None:
        with cpu_server(self.environment):
            self.server.abort_request(self.m.AbortReq(rid=rid))
        self._forget_done()

    @property
    def listed_flags(self) -> dict:
        """Every flag this server runs with (``poolfuzz configs``): not ``mamba_chunk_size``, a model field."""
        return {k: v for k, v in self.server_args.items() if k != "mamba_chunk_size"}

    @property
    def flushes(self) -> bool:
        """Whether its cache is flushed: 0.5.16 on, whose ``flush_cache`` runs on the state this path builds."""
        return compat.plans_with_context(self.m.Scheduler)

    def flush(self) -> bool:
        """An operator's ``/flush_cache``: SGLang's own ``Scheduler.flush_cache`` (an idle server's tree, request pool
        and allocators reset); whether it flushed. Its refusal goes to the root logger, so warnings are off meanwhile."""
        with cpu_server(self.environment), root_warnings_off():
            return bool(self.server.flush_cache())

    def close(self) -> None:
        """The example is over: nothing of this server outlives it (a HiCache server's storage threads stop)."""

    def _abort_sent(self, output, req) -> None:
        self.aborted.add(req.rid)

    def _forget_done(self) -> None:
        for rid in [rid for rid, req in self.requests.items() if req.finished() or rid in self.aborted]:
            self.outcome[rid] = "aborted" if rid in self.aborted or _aborted(self.requests[rid]) else "finished"
            del self.requests[rid]

    # --- checks --------------------------------------------------------------------------------
    def state_problem(self) -> str | None:
        """After every rule, SGLang's own invariant checker as a strict server runs it after a batch
        (``compat.engine_invariant_problem``); where it finds a page both owned and free, which request holds it at
        which position."""
        problem = compat.engine_invariant_problem(self.server, idle=False)
        if problem is None:
            return None
        return problem + "".join(f"; {detail}" for detail in self._held_free()[:1])

    def _held_free(self) -> list[str]:
        """Each slot a request in flight holds that the allocator also lists free, named."""
        full = self.family.free_lists().get("full")
        req_to_token = self.family.sg_req_pool.req_to_token
        out = []
        for req in compat.requests_owning_rows(self.server) if full is not None else []:
            for position, slot in enumerate(req_to_token[compat.request_row(req), :req.kv.kv_allocated_len].tolist()):
                if full.is_free_page(page := slot // full.page_size):  # a free list of pages, on a paged pool
                    out.append(f"req {req.rid} holds slot {slot} (page {page}) at position {position}, listed free")
        return out

    def drain(self) -> str | None:
        """Run the idle server until every request finished, closing each open streaming session once its last turn
        is answered (a client that is done closes them); what is wrong then (leaked: with the sessions and their
        turns, where any). Requests it never finishes raise ServerStuck."""
        idle = 0  # drain steps in a row that ran no batch
        for _ in range(DRAIN_STEPS):
            # an open session holds its row and KV: its client closes it once its last turn is answered, or gives up
            # on the turn and closes it where the server has run nothing for a few steps while the turn waits (a pool
            # too small for a turn beside what the sessions hold)
            self.session_clients.close_all(give_up=idle >= STALLED_STEPS)
            if not self.requests and self.server.last_batch is None:
                break
            self.step()
            idle = idle + 1 if self.server.last_batch is None else 0
        if self.requests:
            stuck = ", ".join(f"req {rid} {self._where(r)} with {len(r.output_ids)} of {r.sampling_params.max_new_tokens} "
                              "tokens out" for rid, r in list(self.requests.items())[:4])
            held = self.session_clients.held_after_close()
            because = (f"; the server still holds session(s) {', '.join(held)}, closed by their clients with no turn "
                       "left, their close deferred for a turn it counts in flight or never finished") if held else ""
            raise ServerStuck(f"{len(self.requests)} request(s) still unfinished after {DRAIN_STEPS} idle steps "
                              f"({stuck}){because}", held="session" if held else None)
        if not compat.fully_idle(self.server):
            return "every request finished, but the server is not idle"
        problem = compat.engine_invariant_problem(self.server, idle=True)  # on_idle's leak checks, strict
        return problem and problem + self.session_clients.told()

    def _where(self, req) -> str:
        s = self.server
        if req in s.waiting_queue:
            if s.running_batch.is_empty() and s.running_batch.batch_is_full:
                # nothing is left to leave the batch, and only a leaving request clears the flag
                return "waiting (the running batch is empty but marked full, so the scheduler admits nothing)"
            return "waiting"
        if req is s.chunked_req:
            return "mid-prefill (chunked)"
        return "running" if req in s.running_batch.reqs else "in no queue"


drift_checked(SglangSchedulerDriver, DRIVER_CALLS)


class ContextLoop:
    """One step of 0.5.23's ``event_loop_normal``: the batch plan, the result processor, ``on_idle``'s ratio reset."""

    def __init__(self, server, processor):
        self.server, self.processor = server, processor

    def next_batch(self):
        s = self.server
        s.metrics_reporter.num_retracted_reqs = 0  # update_running_batch sets it to the step's retractions
        plan = s.get_next_batch_to_run(s.running_batch, s.last_batch)
        s.running_batch = plan.running_batch
        return plan.batch_to_run

    def retractions(self) -> int:
        return self.server.metrics_reporter.num_retracted_reqs

    def finish(self, batch, result, *, counted: bool = False) -> None:
        s = self.server
        if batch.extend_num_tokens and not counted:  # run_batch's counter (counted: by run_batch itself)
            s.processed_tokens_counter += batch.extend_num_tokens
        if batch.forward_mode.is_extend():
            self.processor.process_batch_result_prefill(batch, result)
        else:
            self.processor.process_batch_result_decode(batch, result)
        compat.flush_pending_backups(s.tree_cache)  # as process_batch_result ends
        s.last_batch = batch

    def idle(self) -> None:
        s = self.server
        s.last_batch = None
        if s.is_fully_idle():  # on_idle: a fully idle server compacts a unified pool, resets the new-token ratio
            compat.idle_compaction(s)
            s.new_token_ratio_tracker.reset()


def served(config: ModelConfig) -> ModelConfig:
    """The config as the server this path runs builds it: ``event_loop_normal`` is a server without the overlap
    schedule (``--disable-overlap-schedule``), whose extra buffer gives a request one track slot, not a ping-pong
    pair (SGLang's ``get_mamba_tracking_slots``)."""
    if config.mamba_track_slots > 1:
        return config.replace(mamba_track_slots=1)
    return config


@contextlib.contextmanager
def backups_own_memory(family):
    """Stood in for, the GPU's device-to-host copy: on a CPU a retraction backup SGLang's ``Req.offload_kv_cache``
    takes can be a view of the live pool row it backs up (``tensor.to("cpu", non_blocking=True)`` returns the tensor
    itself; a 0-d slot index gives a view), which the next request given that row overwrites before the retracted one
    resumes. Right after each offload (before ``release_req`` frees a slot) the backup's aliased tensors are copied,
    as a GPU's copy would be, and recorded (``scheduler.backups.unalias_backup``)."""
    from sglang.srt.managers.schedule_batch import Req

    offload = Req.offload_kv_cache

    def offloaded(req, *args, **kwargs):
        result = offload(req, *args, **kwargs)
        unalias_backup(req, family, req.rid)
        return result

    with mock.patch.object(Req, "offload_kv_cache", offloaded):
        yield


def server_arguments(config: ModelConfig, *, max_running_requests: int) -> dict:
    """The flags of the server this path runs (``ServerArgs`` fields; the rest at their defaults, --max-prefill-tokens
    16384 among them): the config's scheduling flags (named configs: fcfs, chunks of 16 tokens so that prompts are
    chunked, a conservativeness of 0.1 so that the server admits on a small estimate of what running requests will
    still take, and under load decode runs out of slots and retract_decode takes requests back; drawn configs draw
    them), and for a model with recurrent state the mamba radix cache's strategy its pools were built for
    (``extra_buffer``: a track slot pair per request; ``no_buffer``: none)."""
    flags = dict(schedule_policy=config.schedule_policy, schedule_conservativeness=config.conservativeness_pct / 100,
                 max_running_requests=max_running_requests, page_size=config.page_size, disable_overlap_schedule=True)
    # scaled by the unit prompts are drawn in (a drawn long-context model's prompts are thousands of tokens: chunked
    # by 16 they would take more steps than an example drains in); a server refuses a chunked prefill size that is not
    # a whole number of pages (its validation hook asserts it)
    chunk = config.chunked_prefill * config.traffic_unit
    flags["chunked_prefill_size"] = -(-chunk // config.page_size) * config.page_size if chunk else -1
    if config.has_mamba:
        flags.update(mamba_radix_cache_strategy="extra_buffer" if config.mamba_track_slots else "no_buffer",
                     mamba_track_interval=MAMBA_TRACK_INTERVAL, mamba_chunk_size=MAMBA_CHUNK)
    return flags | speculative_flags(config)


def _aborted(req) -> bool:
    """Whether the server finished ``req`` with an abort (``FINISH_ABORT``), not a stop or length."""
    return type(req.finished_reason).__name__ == "FINISH_ABORT"
