"""SGLang's own PD decode server on the CPU (``--family sglang:decode``): prefilled requests arrive, are pre-allocated,
transferred, decoded, retracted with their KV backed up, and resumed, each by SGLang's code.

What runs is SGLang's as shipped: ``Scheduler.init_disaggregation`` builds the decode side's queues
(``DecodePreallocQueue``, ``DecodeTransferQueue``, their KV manager and metadata buffers) over the family's pools and
tree. A request enters as ``handle_generate_request`` hands it on (``_add_request_to_queue``:
``DecodePreallocQueue.add``, with a receiver of the ``fake`` transfer backend, the one SGLang's own warm-up requests
use). Each step is one iteration of ``event_loop_normal_disagg_decode``: ``process_decode_queue``
(``resume_retracted_reqs``: a retracted request pre-allocated again and its KV restored from its backup;
``pop_preallocated``: the pre-allocation budgets and ``_pre_alloc``; ``pop_transferred``),
``get_next_disagg_decode_batch_to_run`` (the prebuilt batch merged into the running one, ``update_running_batch``:
``check_decode_mem``, ``retract_decode`` with ``release_req``'s KV backup, ``prepare_for_decode``), the forward, and
``process_batch_result_decode``.

The backup is SGLang's to choose, as on a server started without ``--disaggregation-decode-retraction-backup``:
``kv_cache_builder.resolve_decode_retraction_backup`` runs on the built pools (:meth:`SglangDecodeDriver.pools_built`)
and picks ``host_pool`` for a model whose KV is full-attention, or SWA with full tokens, and keeps no recurrent state
(0.5.18: whatever its layers), else ``cpu_tensor``. With ``host_pool`` the registry's disabled ``UnifiedRadixCache``
gets its host tier (``init_hicache``: the host pool group and cache controller sized by the resolved
``--hicache-ratio``), ``validate_retraction_host_capacity`` checks it as ``build_kv_cache`` does, and a retraction
goes through the tree's ``backup_kv_cache`` / ``restore_kv_cache`` (0.5.18: ``retraction_backup`` /
``retraction_restore``). A run's ``--backup-mode`` names the flag instead. The model-runner stand-in checks, before every forward, that each request attends to
its own K and V at every position: after a transfer, and after a retraction and its restore.

Stood in for, and why:

* the prefill node and its transfer engine (with the fake backend nothing is sent): where the decode side's
  ``send_metadata`` names the pre-allocated pages of a prompt (from ``decode_prefix_len``), the stand-in writes what a
  prefill node's transfer lands there, the prompt's K and V as the model-runner stand-in computes them. The first
  token is the one the fake path commits (0.5.23's hand-off token, ``_generate_fake_prefill_handoff_output_id``; the
  zeroed metadata buffer's 0 before it), taken as the prefill's sample.
* the process groups of one rank: the transfer queue's all-reduce runs over a real one-rank gloo group.
* the TpModelWorker's model facts the queues and the backup's resolution read (layer count, KV heads, KV cache dtype
  name; its HF config, a real ``transformers`` config of a model family with the config's kind of layers:
  :func:`~poolfuzz.adapters.sglang.pools.server_models.hf_model_config`), and its pools and load-back counter registration (:func:`worker_standin`).
* the request pool's extra rows, where SGLang's own configurator does not build the pools here
  (``pools/configurator.py``, with :data:`ROLE_FLAGS`; then its PD hook sizes them): SGLang's
  ``DecodeReqToTokenPool`` (``HybridMambaDecodeReqToTokenPool`` with mamba layers) as the configurator builds it,
  with the PD hook's default extra rows (:meth:`build_family`).

Server flags besides the scheduler path's: ``--disaggregation-mode decode``, ``--disaggregation-transfer-backend
fake`` and ``--num-reserved-decode-tokens 1``: the headroom
each active request keeps for decode steps, scaled to these pools (the default, 512, is about half a percent of a
GPU's pool; here it would exceed the pool, so nothing would ever be pre-allocated). With it the pre-allocation budget
admits on what running requests could give back, and decode runs short and retracts, as a loaded server does.

On the releases that keep one global ServerArgs (0.5.9 to 0.5.15) the server is ``scheduling_global``'s, made a
decode server the same way: the same ``init_disaggregation``, stepped as that release's
``event_loop_normal_disagg_decode`` (:class:`GlobalDecodeLoop`; 0.5.9 plans the prebuilt batch as a batch of its own,
which ``run_batch`` answers with ``_run_batch_prebuilt``). Those releases back every retracted request up as
per-request CPU tensors (``Req.offload_kv_cache``: no flag, no host pool); their pools are the ones their model
runner builds for the decode server (no configurator before 0.5.16): SGLang's ``DecodeReqToTokenPool`` /
``HybridMambaDecodeReqToTokenPool`` among them; before 0.5.12 the
decode side names one state item, of the kind its ``KVArgs.state_type`` says (the fake backend's KV manager is made
to keep them: ``compat.transfer_args_kept``), and 0.5.9 names a request's pages with ``init``, not ``send_metadata``. A decode server
takes no streaming sessions (their turns are the prefill node's).

A model with mamba layers gets its recurrent state from the prefill stand-in too (the state after the prompt, into
the mamba slot the ``MAMBA`` state item of ``send_metadata`` names), and the runner checks the state each request
continues from, after a restore too. Its extra-buffer configs are declined: a decode server keeps no radix cache, so
no track slots.
"""

from __future__ import annotations

import types

from poolfuzz.adapters.sglang import compat
from poolfuzz.adapters.sglang.pools.server_models import hf_model_config
from poolfuzz.adapters.sglang.scheduler.scheduling import (ContextLoop, SglangSchedulerDriver, scheduler_modules,
                                                         server_arguments)
from poolfuzz.adapters.sglang.scheduler.model_facts import tokens_per_layer
from poolfuzz.adapters.sglang.scheduler.scheduling_global import GlobalLoop
from poolfuzz.adapters.sglang.shims import one_rank_group
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

# What makes the server a decode server, for SGLang's configurator (whose resolution, with a model, derives the rest).
# Its mamba cache is left to SGLang (None: ServerArgs' default, no --max-mamba-cache-size): without a radix cache, the
# configurator gives it a state slot per running request (``_handle_max_mamba_cache``), as for a server an operator
# launches.
ROLE_FLAGS = {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake", "max_mamba_cache_size": None}
DECODE_FLAGS = {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake", "num_reserved_decode_tokens": 1,
                # what SGLang's PD hook resolves for a decode server without --disaggregation-decode-enable-radix-cache
                # (which the fake backend refuses): its launcher's resolution pipeline needs a model, so it is stated
                "disable_radix_cache": True}


def decode_shaped(config: ModelConfig) -> ModelConfig:
    """A drawn config as a decode server serves a model of its layers (the decode factories' ``model_shaped``): the
    model's shape (``server_models.model_shaped``), and its recurrent state without the extra buffer's track slots,
    which a decode server keeps none of (it runs without a radix cache: ``decode_problem``), so a draw of the
    prefill side's strategy runs as the decode server it meets instead of being declined."""
    from poolfuzz.adapters.sglang.pools.server_models import model_shaped

    shaped = model_shaped(config)
    return shaped.replace(mamba_track_slots=0) if shaped.mamba_track_slots else shaped


def decode_problem(config: ModelConfig) -> str | None:
    """Why the decode server does not drive ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.api import first_importable, load

    api = load()  # the CPU shims go in before any sglang import
    if config.mamba_track_slots:
        return ("a decode server runs without a radix cache (the fake backend refuses "
                "--disaggregation-decode-enable-radix-cache), so it keeps no extra-buffer track slots for it")
    if config.has_mamba and config.has_swa and compat.decode_names_one_state_item():
        return (f"SGLang {api.version}'s decode side names one state item per request, chosen by its KV pool's kind "
                "(KVArgs.state_type): for a model with sliding-window and mamba layers that is the window, so no "
                "recurrent state would reach the decode server (no model of this release has both kinds of layer)")
    if first_importable("sglang.srt.disaggregation.fake.conn:FakeKVReceiver", required=False) is None:
        return (f"SGLang {api.version} has no fake transfer backend (FakeKVReceiver), whose receiver the decode "
                "server runs")
    return None


class DecodeLoop(ContextLoop):
    """One step of ``event_loop_normal_disagg_decode``: the decode queues, then the batch plan."""

    def __init__(self, server, processor, on_transferred):
        super().__init__(server, processor)
        self.on_transferred = on_transferred

    def next_batch(self):
        s = self.server
        s.metrics_reporter.num_retracted_reqs = 0
        s.process_decode_queue()
        self.on_transferred(s.waiting_queue)
        plan = s.get_next_disagg_decode_batch_to_run(running_batch=s.running_batch)
        s.running_batch = plan.running_batch
        return plan.batch_to_run


class GlobalDecodeLoop(GlobalLoop):
    """One step of a global-ServerArgs release's ``event_loop_normal_disagg_decode``: the decode queues, then the
    batch plan; its result through ``process_batch_result`` (a decode server's prebuilt batch is processed while
    planned)."""

    def __init__(self, server, on_transferred):
        super().__init__(server)
        self.on_transferred = on_transferred

    def next_batch(self):
        s = self.server
        s.num_retracted_reqs = 0
        compat.retractions_reset(s)
        s.process_decode_queue()
        self.on_transferred(s.waiting_queue)
        batch = s.get_next_disagg_decode_batch_to_run()
        s.cur_batch = batch
        return batch


class SglangDecodeDriver(SglangSchedulerDriver):
    """One example's PD decode server: SGLang's decode queues and Scheduler, a prefill stand-in, the model runner."""

    role = "DECODE"
    label = "the sglang decode server"
    family_name = "sglang:decode"
    drives_speculative = False  # its own spec rounds (decode-side drafts, load-backs under a draft) are not yet
    takes_sessions = False  # a session's turns are prefilled, and its prefix kept, on the prefill node
    retraction = "backs retracted requests up as SGLang resolves (host_pool, or cpu_tensor)"
    backup_modes = ("cpu_tensor", "host_pool")
    resolves_on_pools = True

    def __init__(self, config: ModelConfig, *, backup_mode: str | None = None):
        reason = decode_problem(config)
        if reason:
            raise ConfigError(f"the sglang decode server cannot build {config.name!r}: {reason}")
        self.handed_off: set[str] = set()  # requests whose prefill hand-off (KV and first token) has landed
        super().__init__(config, backup_mode=backup_mode)

    @property
    def host_backup_tokens(self) -> int | None:
        """Token slots of the host pool retractions back up into (``host_pool``), or None (``cpu_tensor``)."""
        from poolfuzz.adapters.sglang import compat

        return min(pool.size for pool in compat.host_pools(self.tree)) if self.backup_mode == "host_pool" else None

    @property
    def transferred(self) -> int:
        """Requests whose KV arrived through the transfer queue."""
        return len(self.handed_off)

    def server_flags(self, config: ModelConfig, *, max_running_requests: int) -> dict:
        """The scheduler path's flags and :data:`DECODE_FLAGS`; ``--disaggregation-decode-retraction-backup`` only
        where the run names one (unset, SGLang resolves it on the built pools: :meth:`pools_built`)."""
        from poolfuzz.adapters.sglang import compat

        chosen = {"disaggregation_decode_retraction_backup": self.named_backup} if self.named_backup else {}
        if chosen and not compat.has_retraction_backup_flag():  # the release's one path is per-request CPU tensors
            if self.named_backup != "cpu_tensor":
                raise ConfigError(f"SGLang {compat.release()} has no --disaggregation-decode-retraction-backup: its "
                                  "decode server backs retracted requests up as per-request CPU tensors (leave "
                                  "--backup-mode unset, or name cpu_tensor)")
            chosen = {}
        return server_arguments(config, max_running_requests=max_running_requests) | DECODE_FLAGS | chosen

    def pools_built(self):
        """SGLang's own resolution of the retraction backup on the built pools
        (``kv_cache_builder.resolve_decode_retraction_backup``, as ``Scheduler.init_memory_pools`` runs it): where the
        run names none, ``host_pool`` for a model of full-attention or SWA-with-full KV without recurrent state, else
        ``cpu_tensor``; with ``host_pool`` the tree gets the host tier it backs up into. The TP worker it reads is
        :func:`worker_standin`."""
        from poolfuzz.adapters.sglang import compat

        worker = worker_standin(self.family, self.config, self.m.SpeculativeAlgorithm.NONE)
        self.backup_mode = compat.resolve_decode_retraction_backup(worker)  # what an artifact records
        self.hf_config = worker.model_runner.model_config.hf_config
        return worker

    def build_family(self, config: ModelConfig, max_running: int):
        """The pools SGLang's configurator builds with the decode server's role flags (its PD hook resolving the
        extra rows for requests in pre-allocation and transfer from the model)."""
        from poolfuzz.adapters.sglang.pools.family import build_sglang_family

        return build_sglang_family(config, role_flags=ROLE_FLAGS, listing=self.family_name)

    # SGLang sizes this server's window pool from its requests' windows, not the ratio's (``server_sized``)
    pool_flags = ROLE_FLAGS

    def _build_context_server(self, config: ModelConfig, max_running: int) -> None:
        from sglang.srt.runtime_context import get_server_args

        super()._build_context_server(config, max_running)
        self._decode_side(get_server_args(), batch_result_processor=self.loop.processor)
        self.loop = DecodeLoop(self.server, self.loop.processor, self._take_handoffs)

    def _build_global_server(self, config: ModelConfig, max_running: int) -> None:
        """A 0.5.9-0.5.15 decode server: the global-ServerArgs Scheduler (``scheduling_global``) with the decode
        queues its ``init_disaggregation`` builds, stepped as that release's ``event_loop_normal_disagg_decode``."""
        super()._build_global_server(config, max_running)
        self._decode_side(self.server.server_args)
        self.loop = GlobalDecodeLoop(self.server, self._take_handoffs)

    def _decode_side(self, server_args, **state) -> None:
        """What ``Scheduler.__init__`` leaves for ``init_disaggregation`` on a one-rank decode server beside the
        scheduler path's state (and ``state``): its ranks and CPU group published; the decode queues that builds."""
        s, config, group = self.server, self.config, one_rank_group()
        compat.publish_single_rank(group)
        # what the TpModelWorker knows of the model, as far as the decode queues read it
        s.model_config.num_hidden_layers = config.full_layers + config.swa_layers + config.mamba_layers
        s.model_config.get_total_num_kv_heads = lambda: 1
        s.model_config.hf_config = self.hf_config
        s.tp_worker.model_runner.kv_cache_dtype_str = "auto"
        s.tp_worker.model_runner.swa_max_total_num_tokens = tokens_per_layer(self.family)[1]
        s.tp_worker.is_hybrid_swa = config.has_swa
        # the decode queues answer a request they cannot take (an abort) through the output streamer
        s.output_streamer = types.SimpleNamespace(stream_output=self._streamed)
        # no GPU: 0.5.20 reads the rank's device off its placement (0.5.23: get_device()), 0.5.12 off the Scheduler
        s.ps.gpu_id = None
        s.__dict__.update(gpu_id=None, attn_tp_cpu_group=group,  # 0.5.20 hands the queues the group itself
                          draft_worker=None, random_seed=1, enable_unified_memory=self.unified, enable_decode_hicache=False,
                          server_args=server_args, **state)
        try:
            with compat.transfer_args_kept():
                s.init_disaggregation()
        except (AssertionError, ValueError, NotImplementedError) as exc:  # what a decode server refuses to start with
            raise ConfigError(f"the sglang decode server cannot build {config.name!r}: SGLang's decode queues refuse "
                              f"it ({exc})") from None
        s.future_map = compat.relay_future_map(s.spec_algorithm, s.req_to_token_pool)  # init_overlap's

    # --- the prefill node ------------------------------------------------------------------------
    def _queue(self, req) -> None:
        """A request a prefill node has taken: it names the fake bootstrap host, and the prefill stand-in listens
        for where the decode side wants its KV."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = FAKE_BOOTSTRAP_HOST, 8998, int(req.rid)
        super()._queue(req)
        for decode_req in self.server.disagg_decode_prealloc_queue.queue:
            if decode_req.req is req:
                self._listen(decode_req)

    def _listen(self, decode_req) -> None:
        receiver, req = decode_req.kv_receiver, decode_req.req
        method = compat.receiver_metadata_method(receiver)
        send = getattr(receiver, method)
        c = self.config

        def send_metadata(kv_indices, aux_index=None, state_indices=None, *rest, **kwargs):
            decode_prefix_len = rest[0] if rest else kwargs.get("decode_prefix_len")  # 0.5.16 on
            page = c.page_size
            start, length = decode_prefix_len or 0, len(req.origin_input_ids)
            slots = [int(p) * page + j for p in kv_indices for j in range(page)]
            named = compat.typed_state_items(self.server.disagg_decode_prealloc_queue.kv_manager, state_indices)
            swa_rows = None  # the SWA window's rows, where the SWA state item names them (from the page its start is on)
            if "SWA" in named:
                rows = [int(p) * page + j for p in named["SWA"].reshape(-1).tolist() for j in range(page)]
                swa_rows = (-(-length // page) * page - len(rows), rows)
            self.runner.receive_prefill(req.rid, start=start, slots=slots[:length - start], swa_rows=swa_rows)
            # the recurrent state after the prompt, into the mamba slot the MAMBA state item names
            for slot in named["MAMBA"][0].reshape(-1).tolist() if "MAMBA" in named else []:
                self.runner.receive_prefill_state(req.rid, slot=int(slot), tokens=length)
            return send(kv_indices, aux_index, state_indices, *rest, **kwargs)

        setattr(receiver, method, send_metadata)

    def _streamed(self, reqs, *args, **kwargs) -> None:
        """What the server streams to the tokenizer manager: an abort answers the request."""
        for req in reqs:
            if type(req.finished_reason).__name__ == "FINISH_ABORT" or req.to_finish is not None:
                self.aborted.add(req.rid)

    def _take_handoffs(self, waiting) -> None:
        """Requests the transfer queue has just committed: the prefill's first token is theirs now."""
        for req in waiting:
            if req.rid not in self.handed_off and req.output_ids:
                self.handed_off.add(req.rid)
                self.runner.receive_first_token(req.rid, int(req.output_ids[-1]))

    def state_problem(self) -> str | None:
        """After every rule, SGLang's page invariants (no page both owned and free, none free twice); not the busy
        check's slot count, which ``event_loop_normal_disagg_decode`` never runs (pre-allocated requests hold slots
        outside every batch it counts)."""
        from poolfuzz.adapters.sglang import compat

        problem = compat.engine_invariant_problem(self.server, idle=False, conservation=False)
        return problem and problem + "".join(f"; {detail}" for detail in self._held_free()[:1])

    def _where(self, req) -> str:
        queues = self.server.disagg_decode_prealloc_queue
        if any(r.req is req for r in queues.queue):
            return "waiting for pre-allocation"
        if req in queues.retracted_queue:
            return "retracted, waiting to resume"
        if any(r.req is req for r in self.server.disagg_decode_transfer_queue.queue):
            return "waiting for its transfer"
        return super()._where(req)


def worker_standin(family, config: ModelConfig, spec_algorithm):
    """What SGLang's decode-side resolution and tree build read of the TpModelWorker (it loads a model on a GPU): its
    pools, per-side token counts, model config, draft pools (none) and the load-back layer counter's registration
    (the model's attention layers wait on it; the model-runner stand-in waits for the whole load instead)."""
    model_config = types.SimpleNamespace(hf_config=hf_model_config(config), linear_attn_registry_result=None,
                                         is_draft_model=False)
    runner = types.SimpleNamespace(mtp_draft_device_pools=[], mtp_draft_mamba_pools=[], spec_algorithm=spec_algorithm,
                                   model_config=model_config)
    return types.SimpleNamespace(
        get_memory_pool=lambda: (family.sg_req_pool, family.sg_allocator),
        get_tokens_per_layer_info=lambda: (config.full_tokens, config.swa_tokens), is_hybrid_swa=config.has_swa,
        sliding_window_size=config.sliding_window if config.has_swa else None, model_runner=runner,
        register_hicache_layer_transfer_counter=lambda counter: None)


def operator_backup(config: ModelConfig) -> str | None:
    """The ``--disaggregation-decode-retraction-backup`` an operator starts this decode server with where the run names
    none: ``cpu_tensor`` where the server SGLang resolves without the flag does not start and the one with
    ``cpu_tensor`` does, else None (SGLang resolves it). 0.5.23 resolves ``host_pool`` for every
    ``MHATokenToKVPool``, and on the CPU the pools of an MHA model with a KV quant method keep their scales in the
    ``token`` layout, which the MHA host pool refuses at startup ("MHA host transfers do not support KV scale layout
    'token'"; a GPU's MXFP8 pool interleaves them, which its host pool takes since sglang#39089): the server that
    starts there is the one with the flag. ``--backup-mode host_pool`` still asks for the refused one, and is declined
    with SGLang's message."""
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.scheduler.servers import server_refusal

    if not compat.has_retraction_backup_flag():  # before 0.5.18 there is no flag to add
        return None
    if server_refusal(config, SglangDecodeDriver, None) and not server_refusal(config, SglangDecodeDriver, "cpu_tensor"):
        return "cpu_tensor"
    return None


def started_backup(config: ModelConfig, backup_mode: str | None) -> str | None:
    """The backup flag the decode server is started with: the run's, or where it names none the operator's
    (:func:`operator_backup`; None: SGLang resolves it)."""
    return backup_mode or operator_backup(config)


def unsupported_reason(config: ModelConfig, *, backup_mode: str | None = None) -> str | None:
    """Why the decode server (with the run's ``backup_mode``; unset, SGLang's resolution, or the flag an operator
    starts it with: :func:`operator_backup`) does not drive ``config``."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as scheduler_reason

    if problem := decode_problem(config):
        return problem
    return scheduler_reason(config, SglangDecodeDriver, backup_mode=started_backup(config, backup_mode))


def build_decode_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> SglangDecodeDriver:
    """The ``sglang:decode`` factory's driver (``servers.build_driver``'s checks of the run's options), started with
    the run's ``backup_mode``, or where it names none with the flag an operator would add (:func:`operator_backup`)."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    if decode_problem(config) is None:
        backup_mode = started_backup(config, backup_mode)
    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode, driver_cls=SglangDecodeDriver)
