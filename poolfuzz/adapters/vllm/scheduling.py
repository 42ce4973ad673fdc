"""vLLM's own ``Scheduler``, built on the CPU from a real ``VllmConfig``, fed by a worker stand-in (issue 30).

What runs is vLLM's as shipped: ``vllm.v1.core.sched.scheduler.Scheduler`` (admission, chunked prefill
under a token budget, prefix-cache hits, preemption under memory pressure and resumption, finishing at
``max_tokens``, aborts) over the KV cache manager, block pool and single-type managers below it. Nothing
here decides what the scheduler decides: which request runs, how far a chunk goes, which blocks it gets,
who is preempted, all come from ``schedule()`` and are read from its ``SchedulerOutput``.

What is stood in for, and why:

* the model and its GPU worker: :class:`Worker` does with each ``SchedulerOutput`` what the GPU model
  runner does with the KV cache. It keeps each request's block table per KV cache group as the output
  gives it (new requests, appended blocks, a request re-sent after preemption), zeroes the blocks the
  scheduler names and runs its block copies, checks that every position the forward attends to holds the
  KV of exactly the request's tokens up to it, writes the K and V of exactly the scheduled positions, and
  samples a token determined by the tokens so far. Contents derive from tokens alone (a chained hash of
  the token ids up to a position, salted by layer and component), never from vLLM's bookkeeping, so a
  prefix hit's blocks must hold the prefix's own KV;
* the HF model config: a tiny ``config.json`` (``ModelConfig`` reads it offline from a temp dir);
* ``vllm.triton_utils.HAS_TRITON``: vLLM's CPU platform refuses a ``VllmConfig`` on x86 without
  triton-cpu, which only its kernels need; the scheduler launches none.

Mamba groups run in cache mode "none" (one state block a request, no prefix caching) and "align" (prefix
caching: a state per block of tokens). In both the worker checks that a forward continuing after ``n`` tokens
reads the recurrent state of exactly those ``n`` tokens (a chained hash of them, as for the KV).

Mode "align", as the GPU model runner runs it (``vllm/v1/worker/mamba_utils.py``: ``preprocess_mamba`` before
the forward, ``postprocess_mamba`` after it, 0.16.0 to 0.23.0; 0.34.0's fused ``preprocess_mamba_align`` /
``precopy_mamba_align`` kernels, and its CPU runner's ``MambaHybridModelState.preprocess_state`` in
``vllm/v1/worker/cpu/model_states/mamba_hybrid.py``, decide the same columns). A request's running state lives
in column ``cdiv(computed + scheduled, block_size) - 1`` of its mamba block table (0.16.0 takes the table's last
column: the same one without draft tokens). Before the forward the state it
continues from is copied there from the previous step's column, or, for a request the worker has no column for
(new, resumed after preemption, a prefix hit), from column ``(computed - 1) // block_size``: the hit's last
cached block. The forward writes the state after its last scheduled token into the running column; when that
token ends a block, the state is copied to that block's column (a no-op without draft tokens). A block the
scheduler caches thus holds the state after whatever token its last forward ended on: the scheduler's
block-aligned split (``Scheduler._mamba_block_aligned_split``) is what makes that its block boundary. The worker
follows those functions' column choice and does their copies on the CPU tensors here: the real ones build
CUDA pointer tables and launch Triton copies (``batch_memcpy`` / the fused kernels), which cannot run on a CPU,
and 0.34.0's CPU runner needs a loaded model's state copy functions and input batch.
Not driven yet: speculative decoding, KV connectors.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from poolfuzz.adapters.vllm.api import VllmAPI
from poolfuzz.adapters.vllm.manager import layout_for
from poolfuzz.adapters.vllm.reference import mamba_mode_for
from poolfuzz.adapters.vllm.storage import copy_block, zero_blocks
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, LostKv

MASK = (1 << 63) - 1
_PRIME = 0x100000001B3
COMPONENTS = ("k", "v")


def chain_after(chain: int, token: int, position: int) -> int:
    """The chained hash of a request's tokens through ``position``: what its KV there derives from."""
    return ((chain ^ (token + (position << 32))) * _PRIME) & MASK


def tag(chain: int, layer: int, component: int) -> int:
    """The value a K or V slot holds for a position (its chain), salted by layer and component."""
    return ((chain * 31 + layer * 7 + component + 1) * _PRIME) & MASK


def sampled_token(chain: int, vocab: int) -> int:
    """The token the stand-in model samples after a sequence: determined by the sequence alone."""
    return chain % vocab


@dataclass(kw_only=True)
class Tokens:
    """What the harness knows of a request: every token id (prompt, then samples) and their chains."""

    ids: list[int]
    chains: list[int] = field(default_factory=list)

    def chain(self, position: int) -> int:
        while len(self.chains) <= position:
            p = len(self.chains)
            self.chains.append(chain_after(self.chains[-1] if self.chains else 0, self.ids[p], p))
        return self.chains[position]


class Worker:
    """The GPU model runner's handling of a ``SchedulerOutput``, on real tensors (see the module)."""

    def __init__(self, *, groups, num_blocks: int, block_size: int, sliding_window: int | None,
                 vocab: int, mamba_mode: str = "none"):
        self.output_cls = scheduler_modules().ModelRunnerOutput
        self.output_fields = {f.name for f in dataclasses.fields(self.output_cls)}
        self.groups = groups  # manager.Group per KV cache group
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.vocab = vocab
        self.mamba_mode = mamba_mode
        # One int64 component per (group, layer, K/V), a value per token slot (block * size + offset), and one
        # recurrent state per block of a mamba group (mode "none": a request's one state block; "align": a state
        # per block of tokens, the running one and those the prefix cache keeps).
        self.kv = {(g.index, layer, c): Component(name=f"{g.space}.{name}", layer=layer, space=g.space,
                                                  tensor=torch.zeros(num_blocks * block_size, dtype=torch.int64))
                   for g in groups if g.space != "mamba" for layer in g.layer_ids for c, name in enumerate(COMPONENTS)}
        self.state = {(g.index, layer): Component(name="mamba.state", layer=layer, space="mamba",
                                                  tensor=torch.zeros(num_blocks, dtype=torch.int64))
                      for g in groups if g.space == "mamba" for layer in g.layer_ids}
        self.tables: dict[str, list[list[int]]] = {}  # req id -> block ids per group, as the output gave them
        self.tokens: dict[str, Tokens] = {}  # req id -> its tokens (kept across preemption, as the request's are)
        self.writers: dict[int, tuple[str, int]] = {}  # a tag written -> (req id, position): whose data it is
        self.state_idx: dict[str, int] = {}  # align: req id -> the table column of its running state (vLLM's
        # mamba_state_idx: forgotten when it finishes, is preempted or resumes)
        self.step = 0

    # --- what the scheduler hands over ----------------------------------------------------------
    def execute(self, out) -> object:
        """One forward over ``out``; the ``ModelRunnerOutput`` vLLM's ``update_from_output`` takes."""
        self.step += 1
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
            self.state_idx.pop(rid, None)
        for rid in getattr(out, "preempted_req_ids", None) or ():
            self.tables.pop(rid, None)  # re-sent in full when it resumes
            self.state_idx.pop(rid, None)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = self._resumed(cached)
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in resumed or rid not in self.tables:
                self.tables[rid] = [list(ids) for ids in (blocks or ())]
                self.state_idx.pop(rid, None)
            elif blocks is not None:
                for table, ids in zip(self.tables[rid], blocks):
                    table.extend(ids)
            computed[rid] = cached.num_computed_tokens[i]
        zero = getattr(out, "new_block_ids_to_zero", None) or ()
        zero_blocks(list(self.kv.values()), zero, self.block_size)
        zero_blocks(list(self.state.values()), zero, 1)
        for copy in getattr(out, "kv_cache_block_copies", None) or ():
            for g in self.groups:
                if g.space != "mamba":
                    copy_block(list(self.kv.values()), g.space, copy.src_block_id, copy.dst_block_id, self.block_size)
        if self.mamba_mode == "align":  # preprocess_mamba: every request's state moves before any forward
            for rid, n in out.num_scheduled_tokens.items():
                self._carry_state(rid, computed[rid], computed[rid] + n)
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            start = computed[rid]
            self._check_context(rid, start)
            if self.mamba_mode != "align":
                self._check_state(rid, start)
            self._write(rid, start, start + n)
            self._write_state(rid, start + n)
            tokens = self.tokens[rid]
            if start + n >= len(tokens.ids):  # the forward reached the last known token: it samples one
                next_token = sampled_token(tokens.chain(len(tokens.ids) - 1), self.vocab)
                tokens.ids.append(next_token)
                sampled.append([next_token])
            else:
                sampled.append([])
            req_ids.append(rid)
        return self._output(req_ids, sampled)

    def _resumed(self, cached) -> set[str]:
        """Requests the output re-sends whole (older releases flag them among the cached ones)."""
        flags = getattr(cached, "resumed_from_preemption", None)
        if flags is not None:
            return {rid for rid, f in zip(cached.req_ids, flags) if f}
        return set(getattr(cached, "resumed_req_ids", None) or ())

    def _output(self, req_ids: list[str], sampled: list[list[int]]):
        kw = dict(req_ids=req_ids, sampled_token_ids=sampled)
        optional = dict(req_id_to_index={r: i for i, r in enumerate(req_ids)}, logprobs=None,
                        prompt_logprobs_dict={}, pooler_output=[])
        kw.update({k: v for k, v in optional.items() if k in self.output_fields})
        return self.output_cls(**kw)

    # --- the KV a forward reads and writes --------------------------------------------------------
    def _slot(self, rid: str, group: int, position: int) -> int | None:
        table = self.tables[rid][group]
        index = position // self.block_size
        if index >= len(table):
            return None
        return table[index] * self.block_size + position % self.block_size

    def _attended(self, group, start: int) -> range:
        """The positions before ``start`` the forward's first token attends to in ``group``."""
        if group.space == "swa" and self.sliding_window is not None:
            return range(max(0, start - (self.sliding_window - 1)), start)
        return range(start)

    def _check_context(self, rid: str, start: int) -> None:
        tokens = self.tokens[rid]
        for g in self.groups:
            if g.space == "mamba":
                continue
            for p in self._attended(g, start):
                slot = self._slot(rid, g.index, p)
                chain = tokens.chain(p)
                for layer in g.layer_ids:
                    for c, name in enumerate(COMPONENTS):
                        want = tag(chain, layer, c)
                        got = None if slot is None else int(self.kv[(g.index, layer, c)].tensor[slot])
                        if got != want:
                            raise self._lost(rid, g, layer, name, p, slot, want, got)

    def _state_block(self, rid: str, group) -> int | None:
        table = self.tables[rid][group.index]
        if self.mamba_mode == "align":
            column = self.state_idx.get(rid)
            return table[column] if column is not None and 0 <= column < len(table) else None
        return table[-1] if table else None

    def _column_block(self, rid: str, group, column: int) -> int | None:
        table = self.tables[rid][group.index]
        return table[column] if 0 <= column < len(table) else None

    def _carry_state(self, rid: str, start: int, end: int) -> None:
        """Mode align, ``preprocess_mamba``: the state a forward over ``[start, end)`` continues from is in the
        previous step's running column, or for a request without one (new, resumed, a prefix hit) in column
        ``(start - 1) // block_size``. It must be the state of exactly ``start`` tokens; it is copied into the
        running column ``cdiv(end, block_size) - 1`` the forward reads and writes."""
        mamba = [g for g in self.groups if g.space == "mamba"]
        if not mamba:
            return
        size = mamba[0].block_size
        prev = self.state_idx.get(rid)
        if prev is None:
            prev = (start - 1) // size  # -1 at 0: a first forward starts from no state
        curr = -(-end // size) - 1
        self.state_idx[rid] = curr
        if start == 0:
            return
        chain = self.tokens[rid].chain(start - 1)
        for g in mamba:
            src = self._column_block(rid, g, prev)
            for layer in g.layer_ids:
                want = tag(chain, layer, len(COMPONENTS))
                got = None if not src else int(self.state[(g.index, layer)].tensor[src])
                if got != want:
                    why = None if src else (f"column {prev} of its mamba table is "
                                            + ("the null block" if src == 0 else "missing"))
                    raise self._lost(rid, g, layer, "state", start - 1, src or None, want, got, block_size=1, why=why)
            dst = self._column_block(rid, g, curr)
            if prev != curr and dst is not None:
                copy_block(list(self.state.values()), "mamba", src, dst, 1)

    def _checkpoint_state(self, rid: str, end: int) -> None:
        """Mode align, ``postprocess_mamba``: a forward whose last token ends a block leaves that block's
        column the state after it (the running column already, without draft tokens)."""
        for g in self.groups:
            if g.space != "mamba" or end % g.block_size:
                continue
            src, dst = self._state_block(rid, g), self._column_block(rid, g, end // g.block_size - 1)
            if src is not None and dst is not None and src != dst:
                copy_block(list(self.state.values()), "mamba", src, dst, 1)

    def _check_state(self, rid: str, start: int) -> None:
        """A forward continuing from ``start`` tokens reads the recurrent state of exactly those tokens
        (none at 0: a first forward starts from no state, vLLM's ``has_initial_state`` False)."""
        if start == 0:
            return
        chain = self.tokens[rid].chain(start - 1)
        for g in self.groups:
            if g.space != "mamba":
                continue
            block = self._state_block(rid, g)
            for layer in g.layer_ids:
                want = tag(chain, layer, len(COMPONENTS))
                got = None if block is None else int(self.state[(g.index, layer)].tensor[block])
                if got != want:
                    raise self._lost(rid, g, layer, "state", start - 1, block, want, got, block_size=1)

    def _write_state(self, rid: str, end: int) -> None:
        chain = self.tokens[rid].chain(end - 1)
        for g in self.groups:
            if g.space != "mamba":
                continue
            block = self._state_block(rid, g)
            if not block:
                raise self._lost(rid, g, g.layer_ids[0], "state", end - 1, None, None, None,
                                 why="no state block in the mamba table the output gave" if block is None
                                 else "its running state's column is the null block")
            for layer in g.layer_ids:
                value = tag(chain, layer, len(COMPONENTS))
                self.state[(g.index, layer)].tensor[block] = value
                self.writers.setdefault(value, (rid, end - 1))
        if self.mamba_mode == "align":
            self._checkpoint_state(rid, end)

    def _write(self, rid: str, start: int, end: int) -> None:
        tokens = self.tokens[rid]
        for g in self.groups:
            if g.space == "mamba":
                continue
            for p in range(start, end):
                slot = self._slot(rid, g.index, p)
                if slot is None:
                    raise self._lost(rid, g, g.layer_ids[0], "k", p, None, None, None,
                                     why=f"position {p} has no block in the {g.space} table the output gave")
                chain = tokens.chain(p)
                for layer in g.layer_ids:
                    for c in range(len(COMPONENTS)):
                        value = tag(chain, layer, c)
                        self.kv[(g.index, layer, c)].tensor[slot] = value
                        self.writers.setdefault(value, (rid, p))

    def _lost(self, rid, g, layer, name, position, slot, want, got, why: str | None = None,
              block_size: int | None = None) -> LostKv:
        if why is None:
            if got == 0:
                why = "zeros (never written, or cleared)"
            elif got in self.writers and name == "state":
                owner, pos = self.writers[got]
                tokens = self.tokens[rid]
                own = pos < len(tokens.ids) and tag(tokens.chain(pos), layer, len(COMPONENTS)) == got
                why = (f"the state after {pos + 1} tokens, not {position + 1}: "
                       + (f"its own first {pos + 1}" if own else "another prefix's")
                       + f", written by req {owner}")
            elif got in self.writers:
                owner, pos = self.writers[got]
                why = f"req {owner}'s position {pos}" + (" (another prefix)" if owner != rid else "")
            else:
                why = f"a value nobody wrote ({got:#x})"
        return LostKv(rid=rid, step=self.step, space=g.space, component=f"{g.space}.{name}", layer=layer,
                      position=position, block=None if slot is None else slot // (block_size or self.block_size),
                      slot=slot,
                      expected="" if want is None else f"{want:#x}", found="" if got is None else f"{got:#x}",
                      whose=why)


# ======================================================================================
# The scheduler, built as a server builds it, with the tiny model config it reads
# ======================================================================================
@dataclass(frozen=True, kw_only=True)
class Built:
    scheduler: object  # vllm.v1.core.sched.scheduler.Scheduler
    groups: tuple
    num_blocks: int
    block_size: int
    hash_block_size: int
    mamba_mode: str = "none"  # the mamba groups' cache mode ("none" or "align")


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

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm import triton_utils
        from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
        from vllm.config import ModelConfig as VllmModelConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.structured_output import StructuredOutputManager
    return types.SimpleNamespace(triton_utils=triton_utils, CacheConfig=CacheConfig, DeviceConfig=DeviceConfig,
                                 SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig, ModelConfig=VllmModelConfig,
                                 Scheduler=Scheduler, ModelRunnerOutput=ModelRunnerOutput,
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
                 mamba_mode: str = "none"):
    """One VllmConfig per machine (its construction reads the model config and the platform: seconds)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = scheduler_modules()
    m.triton_utils.HAS_TRITON = True  # stand-in (module docstring): the scheduler launches no kernel
    SchedulerConfig, CacheConfig, DeviceConfig, VllmConfig = m.SchedulerConfig, m.CacheConfig, m.DeviceConfig, m.VllmConfig
    model = m.ModelConfig(model=_model_dir(json.dumps(hf_config(config), sort_keys=True)), skip_tokenizer_init=True,
                            dtype="bfloat16", max_model_len=max_model_len)
    sched_fields = set(inspect.signature(SchedulerConfig).parameters)  # InitVars too (max_model_len)
    sched_kw = dict(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                    enable_chunked_prefill=True, is_encoder_decoder=False)
    scheduler = SchedulerConfig(**{k: v for k, v in sched_kw.items() if k in sched_fields})
    cache_kw = dict(block_size=config.page_size, enable_prefix_caching=caching)
    if mamba_mode != "none":  # the scheduler splits prefills block-aligned in mode align (need_mamba_block_aligned_split)
        cache_kw["mamba_cache_mode"] = mamba_mode
    cache = CacheConfig(**cache_kw)
    # The device is named, not inferred: releases before ~0.30 find no platform on a CPU-only machine
    # with vLLM's CUDA wheel ("Failed to infer device type").
    device = DeviceConfig(device="cpu")
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache, device_config=device)


def build_scheduler(api: VllmAPI, config: ModelConfig, *, budget: int, max_seqs: int) -> Built:
    reason = scheduler_problem(api, config)
    if reason:
        raise ConfigError(f"the scheduler-driven vllm family cannot build {config.name!r}: {reason}")
    m = scheduler_modules()
    Scheduler, StructuredOutputManager = m.Scheduler, m.StructuredOutputManager
    mode = mamba_mode_for(config) if config.has_mamba else "none"
    layout = layout_for(api, config, mode)
    vllm_config = _vllm_config(api, config, budget, max_seqs, layout.max_model_len, layout.caching, mode)
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
                 hash_block_size=hash_block_size, mamba_mode=mode)




# ======================================================================================
# The driver: what the harness's ScheduledMachine calls (harness/scheduled.py)
# ======================================================================================
DRAIN_STEPS = 400  # steps an idle scheduler may take to finish every request before it counts as stuck


class SchedulerDriver:
    """One example's server: vLLM's Scheduler and the worker, driven as an engine core loop drives them."""

    def __init__(self, config: ModelConfig, *, budget: int | None = None, max_seqs: int | None = None):
        from poolfuzz.adapters.vllm.api import load

        self.config = config
        self.api = load()
        seqs = max_seqs or config.request_rows
        # A budget of two pages, so prefills are chunked; vLLM's SchedulerConfig refuses one below max_num_seqs.
        self.built = build_scheduler(self.api, config, budget=budget or max(2 * config.page_size + 1, seqs),
                                     max_seqs=seqs)
        self.scheduler = self.built.scheduler
        self.worker = Worker(groups=self.built.groups, num_blocks=self.built.num_blocks, block_size=config.page_size,
                             sliding_window=config.sliding_window + 1 if config.has_swa else None, vocab=VOCAB,
                             mamba_mode=self.built.mamba_mode)
        self.next_rid = 1
        self.fresh = VOCAB  # prompt token ids past the vocab: two prompts share only the prefixes drawn
        self.preempted = 0  # requests the scheduler preempted (each resumes and is checked again)
        self.hits = 0  # requests scheduled first with computed tokens (prefix hits, checked at their forward)

    def live(self) -> list[str]:
        return sorted(self.scheduler.requests, key=int)

    def add_request(self, *, length: int, share: int, max_tokens: int) -> str:
        """A request of ``length`` new tokens after, where ``share`` > 0, a prefix of an earlier request's."""
        ids: list[int] = []
        known = sorted(self.worker.tokens, key=int)
        if share and known:
            src = self.worker.tokens[known[share % len(known)]].ids
            ids = list(src[:min(len(src), share * self.config.page_size)])
        ids += list(range(self.fresh, self.fresh + length))
        self.fresh += length
        rid = str(self.next_rid)
        self.next_rid += 1
        self.worker.tokens[rid] = Tokens(ids=list(ids))
        self.scheduler.add_request(self.api.new_request(rid, ids, self.built.hash_block_size, max_tokens=max_tokens))
        return rid

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.preempted += len(getattr(out, "preempted_req_ids", None) or ())
        self.hits += sum(1 for n in out.scheduled_new_reqs if n.num_computed_tokens)
        self.scheduler.update_from_output(out, self.worker.execute(out))

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, self.api.RequestStatus.FINISHED_ABORTED)

    def tables_problem(self) -> str | None:
        """Where the worker's full-attention block table of a running request is not the scheduler's (a
        SchedulerOutput that reported blocks wrong), over the blocks its computed tokens fill."""
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

    def drain(self) -> str | None:
        """Run the idle server until every request finished; what is wrong then (stuck, leaked, unresettable)."""
        for _ in range(DRAIN_STEPS):
            if not self.scheduler.requests:
                break
            self.step()
        if self.scheduler.requests:
            return f"{len(self.scheduler.requests)} request(s) still unfinished after {DRAIN_STEPS} idle steps"
        pool = self.scheduler.kv_cache_manager.block_pool
        held = [b.block_id for b in pool.blocks if b.ref_cnt and not b.is_null]
        if held:
            return f"blocks {held} are still held with every request finished (leaked)"
        if not self.scheduler.reset_prefix_cache():
            return "reset_prefix_cache refused with every request finished"
        return None


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why ``--family vllm:scheduler`` does not drive ``config`` with the installed vLLM, or None."""
    from poolfuzz.adapters.vllm.api import load
    from poolfuzz.adapters.vllm.family import unsupported_reason as manager_reason

    return manager_reason(config) or scheduler_problem(load(), config)


def build_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> SchedulerDriver:
    """The ``vllm:scheduler`` factory's driver (the worker's tensors live on the CPU, as the scheduler does)."""
    if tuple(faults):
        raise ConfigError("the vllm:scheduler family runs vLLM's code as shipped: it has no catalogue faults")
    if backup_mode not in (None, "cpu_tensor"):
        raise ConfigError(f"the vllm:scheduler family has no backup_mode {backup_mode!r}: vLLM's scheduler "
                          "recomputes a preempted request")
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
