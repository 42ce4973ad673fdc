"""vLLM's own ``Scheduler``, built on the CPU from a real ``VllmConfig``, fed by a worker stand-in (issue 30).

What runs is vLLM's as shipped: ``vllm.v1.core.sched.scheduler.Scheduler`` (admission, chunked prefill
under a token budget, prefix-cache hits, preemption under memory pressure and resumption, finishing at
``max_tokens``, aborts) over the KV cache manager, block pool and single-type managers below it. Nothing
here decides what the scheduler decides: which request runs, how far a chunk goes, which blocks it gets,
who is preempted, all come from ``schedule()`` and are read from its ``SchedulerOutput``.

What is stood in for, and why:

* the model and its GPU worker: ``adapters/vllm/worker.py``'s :class:`Worker` (its docstring says how it
  follows the GPU model runner, mamba modes none and align included);
* the HF model config: a tiny ``config.json`` (``ModelConfig`` reads it offline from a temp dir);
* ``vllm.triton_utils.HAS_TRITON``: vLLM's CPU platform refuses a ``VllmConfig`` on x86 without
  triton-cpu, which only its kernels need; the scheduler launches none;
* vLLM's startup KV memory check and its front end's prompt-length check: see :func:`fitted_max_model_len`
  and :meth:`SchedulerDriver.add_request`;
* the KV event publisher's transport: the server publishes KV events (``--kv-events-config``) to a "null"
  publisher, and :class:`RouterFeed` takes the batches the scheduler publishes and replays them against the
  prefix cache as a KV-aware router would (``events.EventMirror``), every step;
* the drafter: the worker proposes draft tokens (ngram speculative decoding, see ``worker.py``);
* an external KV store (LMCache, a disaggregated peer): ``connector.py``'s connector plug-in, which vLLM loads
  by module path as it loads any ``--kv-transfer-config`` connector, with the worker doing its transfers.

The server runs with priority scheduling, KV cache metrics sampling every block, KV events where prefix
caching is on, ngram speculative decoding on models without a mamba group, the external store's KV
connector wherever prefix caching is on (on hybrid models where the release's scheduler handles a connector's
hybrid hits, ``connector.hybrid_capable``), and, for a mamba "align" hybrid on multi-token pages where the
release takes prefix hits inside a block, ``--prefix-match-unit 1`` (every token hashed: the scheduler stops a
prefill at the prompt's last token boundary, and a later hit there copies its tail block on write).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from poolfuzz.adapters.vllm import compat
from poolfuzz.adapters.vllm.api import VllmAPI
from poolfuzz.adapters.vllm.events import EventMirror
from poolfuzz.adapters.vllm.manager import VLLM_POOLS, layout_for
from poolfuzz.adapters.vllm.reference import mamba_mode_for
from poolfuzz.adapters.vllm.worker import Worker
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, ServerStuck
from poolfuzz.pools.token_chain import Tokens


@dataclass(frozen=True, kw_only=True)
class Built:
    scheduler: object  # vllm.v1.core.sched.scheduler.Scheduler
    groups: tuple
    num_blocks: int
    block_size: int
    hash_block_size: int
    mamba_mode: str = "none"  # the mamba groups' cache mode ("none" or "align")
    max_model_len: int = 0  # the server's: the longest request its KV cache holds (fitted_max_model_len)
    model_config: object = None  # the server's vllm.config.ModelConfig (what its front end checks a prompt against)
    spec_tokens: int = 0  # its speculative decoding's draft tokens a step (0: none)


def hf_config(config: ModelConfig) -> dict:
    """The HF ``config.json`` of a model with ``config``'s attention shape (no weights are ever read)."""
    heads = config.head_num
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * config.head_dim,
            "intermediate_size": 2 * heads * config.head_dim, "num_attention_heads": heads,
            "num_key_value_heads": heads, "num_hidden_layers": max(1, len(config.layers)), "vocab_size": VOCAB,
            "max_position_embeddings": 1 << 16, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


VOCAB = 1 << 15


@lru_cache(maxsize=1)
def scheduler_modules():
    """vLLM's scheduler, its configs and its worker output, imported once (their import chains warn about
    vLLM's own use of torch APIs, not ours to fail on)."""
    import logging
    import types
    import warnings

    logging.getLogger("vllm").setLevel(logging.WARNING)  # its INFO lines (a prefix cache reset per example) are noise
    # ... and so is the connector base's "this API is experimental" warning, once per server built
    logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.base").setLevel(logging.ERROR)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm import triton_utils
        from vllm import config as configs
        from vllm.v1 import outputs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from poolfuzz.adapters.vllm import connector

        try:  # the store's connector class, which vLLM's factory takes by module path, on vLLM's connector base
            getattr(connector, connector.CONNECTOR)
        except ImportError:
            connector = None
    return types.SimpleNamespace(connector=connector, triton_utils=triton_utils, CacheConfig=configs.CacheConfig,
                                 DeviceConfig=configs.DeviceConfig, SchedulerConfig=configs.SchedulerConfig,
                                 VllmConfig=configs.VllmConfig, ModelConfig=configs.ModelConfig,
                                 SpeculativeConfig=getattr(configs, "SpeculativeConfig", None),
                                 KVEventsConfig=getattr(configs, "KVEventsConfig", None),
                                 KVTransferConfig=getattr(configs, "KVTransferConfig", None),
                                 KVConnectorOutput=getattr(outputs, "KVConnectorOutput", None),
                                 ObservabilityConfig=getattr(configs, "ObservabilityConfig", None),
                                 Scheduler=Scheduler, ModelRunnerOutput=outputs.ModelRunnerOutput,
                                 DraftTokenIds=getattr(outputs, "DraftTokenIds", None),
                                 StructuredOutputManager=StructuredOutputManager)


@lru_cache(maxsize=None)
def _model_dir(text: str) -> str:
    path = tempfile.mkdtemp(prefix="poolfuzz-vllm-model-")
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text)
    return path


def scheduler_problem(api: VllmAPI, config: ModelConfig) -> str | None:
    """Why the scheduler-driven vllm family does not drive ``config`` (yet), or None."""
    if config.has_mamba and mamba_mode_for(config) not in api.mamba_cache_modes:
        return f"vLLM {api.version} has no mamba cache mode {mamba_mode_for(config)!r} (MambaSpec.mamba_cache_mode)"
    if config.attention != "mha" or config.kv_quant or config.kv_scale_block:
        return "only MHA attention with plain K and V is driven through vLLM's scheduler"
    return None


@lru_cache(maxsize=8)
def _vllm_config(api: VllmAPI, config: ModelConfig, budget: int, max_seqs: int, max_model_len: int, caching: bool,
                 mamba_mode: str = "none", spec_tokens: int = 0, connector: bool = False, prefix_match_unit: int = 0):
    """One VllmConfig per machine (its construction reads the model config and the platform: seconds)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = scheduler_modules()
    m.triton_utils.HAS_TRITON = True  # stand-in (module docstring): the scheduler launches no kernel
    SchedulerConfig, CacheConfig, DeviceConfig, VllmConfig = m.SchedulerConfig, m.CacheConfig, m.DeviceConfig, m.VllmConfig
    model = m.ModelConfig(model=_model_dir(json.dumps(hf_config(config), sort_keys=True)), skip_tokenizer_init=True,
                            dtype="bfloat16", max_model_len=max_model_len)
    sched_fields = set(inspect.signature(SchedulerConfig).parameters)  # InitVars too (max_model_len)
    # Priority scheduling (--scheduling-policy priority): requests of one priority run first come first served.
    sched_kw = dict(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                    enable_chunked_prefill=True, is_encoder_decoder=False, policy="priority")
    scheduler = SchedulerConfig(**{k: v for k, v in sched_kw.items() if k in sched_fields})
    cache_kw = dict(block_size=config.page_size, enable_prefix_caching=caching)
    if mamba_mode != "none":  # the scheduler splits prefills block-aligned in mode align (need_mamba_block_aligned_split)
        cache_kw["mamba_cache_mode"] = mamba_mode
    if prefix_match_unit:  # --prefix-match-unit: block hashes (and prefix hits) finer than a block
        cache_kw["prefix_match_unit"] = prefix_match_unit
    cache = CacheConfig(**cache_kw)
    # The device is named, not inferred: releases before ~0.30 find no platform on a CPU-only machine
    # with vLLM's CUDA wheel ("Failed to infer device type").
    device = DeviceConfig(device="cpu")
    extra = {}
    if caching and m.KVEventsConfig is not None:  # as a server publishing to a KV-aware router (--kv-events-config)
        extra["kv_events_config"] = m.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if m.ObservabilityConfig is not None and "kv_cache_metrics" in inspect.signature(m.ObservabilityConfig).parameters:
        # --kv-cache-metrics, every block sampled: deterministic
        extra["observability_config"] = m.ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    if connector:  # --kv-transfer-config naming the external store's connector (connector.py) by module path
        store = m.connector
        extra["kv_transfer_config"] = m.KVTransferConfig(kv_connector=store.CONNECTOR, kv_role="kv_both",
                                                         kv_connector_module_path=store.__name__)
    if spec_tokens:  # ngram: a drafter without a model (the worker stands in for it)
        extra["speculative_config"] = m.SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens,
                                                          prompt_lookup_max=spec_tokens, prompt_lookup_min=1)
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache, device_config=device, **extra)


def fitted_max_model_len(vllm_config, layout) -> int:
    """The longest ``max_model_len``, up to the layout's, whose one request the KV cache holds, so that a
    server with this cache starts: vLLM refuses to start one whose KV cache cannot hold a request of its
    ``max_model_len`` (its startup memory check, ``check_enough_kv_cache_memory``), and with the full prompt
    reserved at admission (0.34's ``scheduler_reserve_full_isl``) it would never admit a prompt the cache
    cannot hold. The memory a request of a length needs is each group spec's own ``max_memory_usage_bytes``,
    in pages of that group, all drawn from the one block pool (block 0 is the null block). Stood in for: the
    check itself, which on 0.33 on needs a KV cache layout the engine core resolves against its workers."""
    groups = layout.kv_cache_config.kv_cache_groups

    def blocks_needed(length: int) -> int:
        probe = copy.copy(vllm_config)
        probe.model_config = copy.copy(vllm_config.model_config)
        probe.model_config.max_model_len = length
        return sum(-(-g.kv_cache_spec.max_memory_usage_bytes(probe) // g.kv_cache_spec.page_size_bytes)
                   for g in groups)

    usable = layout.num_blocks - 1
    low, high = 0, layout.max_model_len  # blocks_needed grows with the length: the last that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if blocks_needed(mid) <= usable else (low, mid - 1)
    if low < 2:
        raise ConfigError(f"a vLLM server with this {layout.num_blocks}-block KV cache would not start: it holds "
                          "no request of two tokens")
    return low


@lru_cache(maxsize=8)
def _server_max_model_len(api: VllmAPI, config: ModelConfig, budget: int, max_seqs: int, mode: str,
                          spec_tokens: int, connector: bool) -> int:
    """:func:`fitted_max_model_len` once per server config (every example builds a server)."""
    layout = layout_for(api, config, mode)
    return fitted_max_model_len(_vllm_config(api, config, budget, max_seqs, layout.max_model_len, layout.caching, mode,
                                             spec_tokens, connector, match_unit(layout, config)), layout)


def match_unit(layout, config: ModelConfig) -> int:
    """The server's ``--prefix-match-unit``: the layout's hash granularity where it is finer than a page (an
    align hybrid on a release that takes hits inside a block, ``manager.hash_block_for``), else unset (0)."""
    return layout.hash_block_size if layout.hash_block_size < config.page_size else 0


def has_connector(config: ModelConfig) -> bool:
    """Whether the server runs the external store's KV connector: where the release's connector API takes it, on
    hybrid models only where ``connector.hybrid_capable`` (vLLM hands it every group's blocks)."""
    m = scheduler_modules()
    if None in (m.KVTransferConfig, m.KVConnectorOutput, m.connector):
        return False
    return not (config.has_swa or config.has_mamba) or m.connector.hybrid_capable()


def spec_tokens_for(api: VllmAPI, config: ModelConfig) -> int:
    """Draft tokens a step the server verifies: :data:`SPEC_TOKENS`, except with a mamba group (the worker does
    not model vLLM's speculative state blocks) or a release without ngram drafts handed to the scheduler."""
    m = scheduler_modules()
    if config.has_mamba or m.SpeculativeConfig is None or m.DraftTokenIds is None:
        return 0
    return SPEC_TOKENS


SPEC_TOKENS = 2


def build_scheduler(api: VllmAPI, config: ModelConfig, *, budget: int, max_seqs: int) -> Built:
    reason = scheduler_problem(api, config)
    if reason:
        raise ConfigError(f"the scheduler-driven vllm family cannot build {config.name!r}: {reason}")
    m = scheduler_modules()
    Scheduler, StructuredOutputManager = m.Scheduler, m.StructuredOutputManager
    mode = mamba_mode_for(config) if config.has_mamba else "none"
    layout = layout_for(api, config, mode)
    spec, connector = spec_tokens_for(api, config), has_connector(config) and layout.caching
    max_model_len = _server_max_model_len(api, config, budget, max_seqs, mode, spec, connector)
    vllm_config = _vllm_config(api, config, budget, max_seqs, max_model_len, layout.caching, mode, spec, connector,
                               match_unit(layout, config))
    vllm_config.cache_config.num_gpu_blocks = layout.num_blocks
    # The scheduling and hashing granularities as the engine core resolves them (vLLM's own function, where
    # the release has it: the LCM of the groups' block sizes; a mamba "none" group's is the longest request).
    resolve = getattr(api.kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    block_size, hash_block_size = (resolve(layout.kv_cache_config, vllm_config) if resolve is not None
                                   else (layout.scheduler_block_size, layout.hash_block_size))
    kw = dict(vllm_config=vllm_config, kv_cache_config=layout.kv_cache_config,
              structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
              log_stats=True, hash_block_size=hash_block_size)
    params = inspect.signature(Scheduler).parameters
    scheduler = Scheduler(**{k: v for k, v in kw.items() if k in params})
    return Built(scheduler=scheduler, groups=layout.groups, num_blocks=layout.num_blocks, block_size=config.page_size,
                 hash_block_size=hash_block_size, mamba_mode=mode, max_model_len=max_model_len,
                 model_config=vllm_config.model_config, spec_tokens=spec)


def default_budget(config: ModelConfig, max_seqs: int) -> int:
    """The server's token budget: two pages, so prefills are chunked (vLLM refuses one below max_num_seqs)."""
    return max(2 * config.page_size + 1, max_seqs)


# ======================================================================================
# The driver: what the harness's ScheduledMachine calls (harness/scheduled.py)
# ======================================================================================
DRAIN_STEPS = 400  # steps an idle scheduler may take to finish every request before it counts as stuck


class RouterFeed:
    """The scheduler's KV event publisher, replaced: each batch it publishes goes to a router's mirror."""

    def __init__(self, mirror: EventMirror):
        self.mirror = mirror

    def publish(self, batch) -> None:
        self.mirror.consume(batch.events)

    def shutdown(self) -> None:
        pass


class SchedulerDriver:
    """One example's server: vLLM's Scheduler and the worker, driven as an engine core loop drives them."""

    streaming_sessions = False  # vLLM keeps no sessions between requests: the machine's session rules never fire
    backup_mode = "cpu_tensor"  # the retraction path an artifact records: vLLM recomputes a preempted request
    pools_origin = VLLM_POOLS  # who built the pools an example runs on (a run counts examples by it)

    def __init__(self, config: ModelConfig, *, budget: int | None = None, max_seqs: int | None = None):
        from poolfuzz.adapters.vllm.api import load

        self.config = config
        self.api = load()
        seqs = max_seqs or config.request_rows
        self.built = build_scheduler(self.api, config, budget=budget or default_budget(config, seqs), max_seqs=seqs)
        self.scheduler = self.built.scheduler
        self.events = None  # what a KV-aware router learns from the server's events (where they are published)
        pool = self.scheduler.kv_cache_manager.block_pool
        if getattr(self.scheduler, "enable_kv_cache_events", False) and EventMirror.supported(
                pool, self.api.kv_cache_utils, self.api.kv_events):
            self.events = EventMirror(pool, self.api.kv_cache_utils, self.api.kv_events)
            self.scheduler.kv_event_publisher = RouterFeed(self.events)
        self.worker = Worker(groups=self.built.groups, num_blocks=self.built.num_blocks, block_size=config.page_size,
                             sliding_window=config.sliding_window + 1 if config.has_swa else None, vocab=VOCAB,
                             output_cls=scheduler_modules().ModelRunnerOutput,
                             mamba_mode=self.built.mamba_mode)
        self.connector = getattr(self.scheduler, "connector", None)  # the external store's, where it runs
        if self.connector is not None:
            window = self.worker.sliding_window if config.has_swa else None
            self.worker.store = scheduler_modules().connector.ExternalStore(config.page_size, groups=self.built.groups,
                                                                            window=window)
            self.worker.connector_output_cls = scheduler_modules().KVConnectorOutput
            self.connector.attach(self.worker.store)
        self.next_rid = 1
        self.fresh = VOCAB  # prompt token ids past the vocab: two prompts share only the prefixes drawn
        self.preempted = 0  # requests the scheduler preempted (each resumes and is checked again)
        self.hits = 0  # requests scheduled first with computed tokens (prefix hits, checked at their forward)
        self.hits_inside_a_block = 0  # ... of a hit that ends inside a block (--prefix-match-unit finer than a page)
        self.refused = 0  # requests the server's front end refused (a prompt too long for its max_model_len)

    def live(self) -> list[str]:
        return sorted(self.scheduler.requests, key=int)

    def add_request(self, *, length: int, share: int, max_tokens: int, priority: int = 0) -> str:
        """A request of ``length`` new tokens after, where ``share`` > 0, a prefix of an earlier request's;
        ``priority`` orders it under priority scheduling (lower runs first, and is preempted last)."""
        ids: list[int] = []
        known = sorted(self.worker.tokens, key=int)
        if share and known:
            src = self.worker.tokens[known[share % len(known)]].ids
            ids = list(src[:min(len(src), share * self.config.page_size)])
        ids += list(range(self.fresh, self.fresh + length))
        self.fresh += length
        refusal = compat.prompt_refusal(self.built.model_config, len(ids))
        if refusal:  # vLLM's front end refuses it before the scheduler sees it
            self.refused += 1
            return f"refused: {refusal}"
        rid = str(self.next_rid)
        self.next_rid += 1
        self.worker.tokens[rid] = Tokens(ids=list(ids))
        self.scheduler.add_request(self.api.new_request(rid, ids, self.built.hash_block_size, max_tokens=max_tokens,
                                                        priority=priority))
        return rid

    @property
    def speculative(self) -> bool:
        return self.built.spec_tokens > 0

    def propose_drafts(self, tokens: int) -> None:
        """From now on the worker's drafter proposes ``tokens`` draft tokens (at most the server's) a step."""
        self.worker.drafts = min(tokens, self.built.spec_tokens)

    def step(self) -> None:
        """One engine core step: ``schedule()``, the forward, ``update_from_output``, then the drafts."""
        out = self.scheduler.schedule()
        self.preempted += len(getattr(out, "preempted_req_ids", None) or ())
        self.hits += sum(1 for n in out.scheduled_new_reqs if n.num_computed_tokens)
        self.hits_inside_a_block += sum(1 for n in out.scheduled_new_reqs if n.num_computed_tokens % self.config.page_size)
        self.scheduler.update_from_output(out, self.worker.execute(out))
        if self.events is not None:  # what it published (nothing, where every event was lost) against the cache
            self.events.check()
        if self.speculative:
            rids, drafts = self.worker.take_drafts()
            self.scheduler.update_draft_token_ids(scheduler_modules().DraftTokenIds(rids, drafts))

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, self.api.RequestStatus.FINISHED_ABORTED)

    def state_problem(self) -> str | None:
        """Where the worker's full-attention block table of a running request is not the scheduler's (a
        SchedulerOutput that reported blocks wrong), over the blocks its computed tokens fill; or where the KV
        events published so far disagree with the prefix cache (checked after every step)."""
        if self.events is not None and self.events.problem:
            return self.events.problem
        full = next(g for g in self.built.groups if g.space == "full")
        manager = self.scheduler.kv_cache_manager
        for request in self.scheduler.running:
            rid = request.request_id
            if rid not in self.worker.tables:
                continue
            blocks = -(-request.num_computed_tokens // self.config.page_size)
            mine = self.worker.tables[rid][full.index][:blocks]
            theirs = list(manager.get_block_ids(rid)[full.index])[:blocks]
            if mine != theirs:
                return (f"req {rid}: the worker's full-attention block table {mine} is not the scheduler's {theirs}: "
                        "a SchedulerOutput reported its blocks wrong")
        return None

    flushes = False  # no cache flush rule (vLLM's reset_prefix_cache is run by drain's checks)

    def close(self) -> None:
        """The example is over; the scheduler holds nothing that outlives it."""

    def drain(self) -> str | None:
        """Run the idle server until every request finished; what is wrong then (leaked, unresettable). Requests it
        never finishes raise ServerStuck."""
        for _ in range(DRAIN_STEPS):
            if not self.scheduler.requests:
                break
            self.step()
        if self.scheduler.requests:
            stuck = ", ".join(f"req {rid} {getattr(r.status, 'name', r.status)} at {r.num_computed_tokens}/{r.num_tokens}"
                              for rid, r in sorted(self.scheduler.requests.items(), key=lambda kv: int(kv[0]))[:4])
            raise ServerStuck(f"{len(self.scheduler.requests)} request(s) still unfinished after {DRAIN_STEPS} idle "
                              f"steps ({stuck})")
        pool = self.scheduler.kv_cache_manager.block_pool
        held = [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null]
        if held:
            return f"blocks {held} are still held with every request finished (leaked)"
        if not self.scheduler.reset_prefix_cache():
            return "reset_prefix_cache refused with every request finished"
        return None


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why ``--family vllm`` does not drive ``config`` with the installed vLLM, or None."""
    from poolfuzz.adapters.vllm.api import load
    from poolfuzz.adapters.vllm.family import unsupported_reason as manager_reason

    return manager_reason(config) or scheduler_problem(load(), config)


def build_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> SchedulerDriver:
    """The ``vllm`` factory's driver (the worker's tensors live on the CPU, as the scheduler does)."""
    from poolfuzz.adapters.vllm.family import refuse_run_options

    refuse_run_options("vllm", faults, backup_mode)
    return SchedulerDriver(config)


def release_problem(api: VllmAPI) -> str | None:
    """Why this release's Scheduler / SchedulerOutput cannot be driven here (yet), or None."""
    try:
        m = scheduler_modules()
    except ImportError as exc:
        return f"vLLM {api.version} has no v1 Scheduler to drive ({exc})"
    params = set(inspect.signature(m.ModelRunnerOutput).parameters)
    if not {"req_ids", "sampled_token_ids"} <= params:
        return f"vLLM {api.version}'s ModelRunnerOutput takes ({', '.join(sorted(params))}), not req_ids / sampled_token_ids"
    return None
