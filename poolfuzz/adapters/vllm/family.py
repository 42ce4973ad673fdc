"""A pool family over vLLM's real v1 KVCacheManager, with worker-side tensors the adapter owns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from poolfuzz.adapters.vllm.api import VllmAPI, load
from poolfuzz.adapters.vllm.compat import block_ids
from poolfuzz.adapters.vllm.events import EventMirror
from poolfuzz.adapters.vllm.manager import VLLM_POOLS, Built, build_manager
from poolfuzz.adapters.vllm.protocol import LiveRequest, VllmProtocol
from poolfuzz.adapters.vllm.reference import VllmReference, mamba_mode_for
from poolfuzz.adapters.vllm.storage import (attention_components, copy_block, mamba_components, null_block_written,
                                            zero_blocks)
from poolfuzz.adapters.vllm.views import BlockSpace, BlockTables, ComponentsView, RowFreeList, SwaTranslator
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.errors import ConfigError


@dataclass(kw_only=True)
class VllmFamily:
    """One node's vLLM KV cache: the manager, its groups as harness spaces, the worker's tensors.

    Capabilities (class attributes the harness reads):
      ``supports_fork`` / ``supports_transfer``: False; a fork is a prefix hit on another request's
      tokens and a transfer needs a KV connector's worker side, neither driven here.
      ``supports_retract``: False; which request is preempted, and how its blocks go back, is the scheduler's
      decision (``Scheduler._preempt_request``), which ``--family vllm`` runs; this family does not restate it.
      ``pads_slot_zero``: False; vLLM pads a batch with slot id -1, which no kernel writes.
      ``shared_unit_spaces``: the spaces of the KV cache groups; every group's blocks come from one
      BlockPool, so a block held in two of them is a violation, however each space looks alone.
      ``caches_freed_units``: True; a freed block keeps its contents for the prefix cache, so only
      blocks that leave the cache uncached are reported to the free listener (and poisoned).
      ``reference_factory``: the reference model of vLLM's block accounting.
      ``supports_next_turn``: True; a finished request's tokens are kept (``finished_tokens``), and a
      next turn's prompt continues them: a local prefix hit on blocks in the free queue.
      ``supports_speculative``: True; the drafts' blocks are allocated and kept, as vLLM keeps them.
      ``pools_origin``: the adapter lays the KV cache groups out (``manager.VLLM_POOLS``).
    """

    supports_fork = False
    supports_transfer = False
    supports_retract = False
    pads_slot_zero = False
    shared_unit_spaces = ("full", "swa", "mamba")
    caches_freed_units = True
    reference_factory = VllmReference
    supports_next_turn = True
    supports_speculative = True
    pools_origin = VLLM_POOLS

    api: VllmAPI
    config: ModelConfig
    device: torch.device
    built: Built
    mamba_mode: str
    backup_mode: str = "cpu_tensor"
    uses_ssm_state: bool = False
    transfer: object = None
    host_pools: dict = field(default_factory=dict)
    live: dict[int, LiveRequest] = field(default_factory=dict)  # by rid, preempted ones included
    by_row: dict[int, LiveRequest] = field(default_factory=dict)
    finished_tokens: dict[int, list[int]] = field(default_factory=dict)  # by rid: what a next turn continues

    def __post_init__(self):
        c, nb = self.config, self.built.num_blocks
        self.manager = self.built.manager
        self.block_pool = self.manager.block_pool
        self.group_of = {g.space: g for g in self.built.groups}
        self.prefix_caching = self.built.caching
        self._attention = []
        for g in self.built.groups:
            if g.space != "mamba":
                self._attention += attention_components(c, g.space, g.layer_ids, nb, self.device)
        self._mamba = mamba_components(c, nb, self.device) if c.has_mamba else []
        self.rows = RowFreeList(c.request_rows)
        self._lists = {"rows": self.rows}
        for g in self.built.groups:
            scale = c.page_size if g.space != "mamba" else 1
            self._lists[g.space] = BlockSpace(space=g.space, block_pool=self.block_pool, scale=scale,
                                              pool_problem=self._pool_problem)
        self.events = None  # the KV events a router would see, replayed (where this release publishes them)
        if self.prefix_caching and EventMirror.supported(self.block_pool, self.api.kv_cache_utils, self.api.kv_events):
            self.events = EventMirror(self.block_pool, self.api.kv_cache_utils, self.api.kv_events)
        self.reset_refused: str | None = None
        self.kv_pool = ComponentsView(self._attention)
        self.req_pool = BlockTables(self)
        if self._mamba:
            self.req_pool.mamba_pool = ComponentsView(self._mamba)
        self.allocator = SwaTranslator(self)
        self.protocol = VllmProtocol()
        self._listener = None

    def __repr__(self) -> str:
        return f"VllmFamily({self.config.name}, vllm {self.api.version}, mamba {self.mamba_mode})"

    # --- the family interface ------------------------------------------------------------------
    def components(self):
        return self._attention + self._mamba

    def host_components(self):
        return []

    def has_recurrent_state(self) -> bool:
        return bool(self._mamba)

    def free_lists(self):
        return dict(self._lists)

    def set_free_listener(self, listener) -> None:
        self._listener = listener
        self.rows.on_free = listener
        for space, lst in self._lists.items():
            lst.on_free = listener

    # --- what the adapter reads ----------------------------------------------------------------
    def block_ids(self, live: LiveRequest, space: str) -> list[int]:
        group = self.group_of.get(space)
        if group is None:
            return []
        return block_ids(self.manager, live.request.request_id, group.index, len(self.built.groups))

    def held_blocks(self) -> dict[int, str]:
        """Every non-null block a live request's table holds, with the space of a group holding it."""
        out = {}
        for live in self.live.values():
            for space in self.group_of:
                for b in self.block_ids(live, space):
                    if b:
                        out.setdefault(b, space)
        return out

    def report_frees(self, before: dict[int, str]) -> None:
        """Tell the listener of the blocks that left every table and the prefix cache since ``before``."""
        if self._listener is None:
            return
        by_space: dict[str, list[int]] = {}
        for b, space in before.items():
            block = self.block_pool.blocks[b]
            if block.ref_cnt == 0 and block.block_hash is None:
                by_space.setdefault(space, []).append(b)
        for space, blocks in by_space.items():
            ids = torch.tensor(sorted(blocks), dtype=torch.int64)
            if space != "mamba":
                ps = self.config.page_size
                ids = (ids[:, None] * ps + torch.arange(ps)).reshape(-1)
            self._listener(space, ids)

    def end_of_schedule(self) -> None:
        """What the scheduler drains from the manager once a step is scheduled: the copies the worker
        runs (copy-on-write of a shared mamba state block) and the blocks they retained, the new block
        ids (for zeroing), the mamba boundary states a connector may offload, and the KV events."""
        m = self.manager
        take_copies = getattr(m, "take_kv_cache_block_copies", None)
        copies, retained = take_copies() if take_copies is not None else ((), ())
        if hasattr(m, "take_new_block_ids"):
            # Where the cache needs zeroing (mamba layers read state before writing it), the worker
            # zeroes every newly allocated attention block before the step's forward: never a hit
            # block; a copy-on-write target first, as the worker zeroes before it copies.
            zero_blocks(self._attention, m.take_new_block_ids(), self.config.page_size)
        if copies:
            # A mamba "align" group copies the state block it keeps writing; every group copies the
            # tail block of a hit inside a block. The copy's target is in the table of the group that
            # copies (or in none: a mamba key moved to it), and only that group's layers are copied.
            held = self.held_blocks()
            for copy in copies:
                space = held.get(copy.dst_block_id, "mamba")
                comps, rows = (self._mamba, 1) if space == "mamba" else (self._attention, self.config.page_size)
                copy_block(comps, space, copy.src_block_id, copy.dst_block_id, rows)
            before = {b.block_id: held.get(b.block_id, "mamba") for b in retained}
            self.block_pool.free_blocks(retained)  # the copy has run: the retention ends
            self.report_frees(before)
        if hasattr(m, "take_boundary_state_offloads"):
            m.take_boundary_state_offloads()  # a connector would offload them; none is modelled
        if self.events is not None:
            self.events.consume(m.take_events())
            self.events.check()
        self.usage = m.usage  # what the scheduler's stats read every step
        if hasattr(m, "make_prefix_cache_stats"):
            m.make_prefix_cache_stats()

    def flush_prefix_cache(self) -> None:
        """An idle server resets its prefix cache (vLLM's ``reset_prefix_cache``, as after a weight
        update): every request has finished, so vLLM must find every block free and succeed."""
        if not self.prefix_caching:
            return
        space_of = {g.index: g.space for g in self.built.groups}
        group_id = getattr(self.api.kv_cache_utils, "get_group_id", lambda key: 0)
        cached = {b.block_id: space_of.get(group_id(b.block_hash), "full")
                  for b in self.block_pool.blocks if b.block_hash is not None and not b.is_null}
        if not self.manager.reset_prefix_cache():
            used = self.block_pool.num_gpu_blocks - 1 - self.block_pool.get_num_free_blocks()
            self.reset_refused = (f"reset_prefix_cache refused with every request finished: {used} block(s) "
                                  "are still not free (leaked)")
        self.end_of_schedule()
        self.report_frees(cached)  # uncached now: the free listener may poison them

    def flush_cache(self) -> None:
        """A mid-run reset of an idle server's cache (``reset_prefix_cache``, which RL frameworks call after
        each weight update): the same as the drain's, then the node serves on."""
        self.flush_prefix_cache()

    def _pool_problem(self) -> str | None:
        ps = self.config.page_size
        written = null_block_written(self.components(), lambda space: 1 if space == "mamba" else ps)
        if written:
            return f"the null block 0 was written ({written}): it pads every block table and must stay empty"
        if self.reset_refused:
            return self.reset_refused
        if self.events is not None and self.events.problem:
            return self.events.problem
        return None


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the installed vLLM cannot run ``config`` here, or None."""
    try:
        api = load()
    except ConfigError as exc:
        return str(exc)
    if config.has_mamba and mamba_mode_for(config) not in api.mamba_cache_modes:
        return f"vLLM {api.version} has no mamba cache mode {mamba_mode_for(config)!r}"
    # Config dimensions the adapter does not drive through vLLM yet: declined, never run as plain MHA.
    if getattr(config, "attention", "mha") != "mha":
        return f"{config.attention.upper()} attention is not driven through vLLM's manager yet (MHA only)"
    if getattr(config, "kv_scale_block", 0):
        return "KV scale buffers are not modelled in the vllm family's worker storage yet"
    if getattr(config, "spec_draft_tokens", 0):
        return "the speculative scratch rows are SGLang's MambaPool's; not driven through vLLM"
    if getattr(config, "kv_quant", ""):
        return f"KV quant method {config.kv_quant!r} is SGLang's; not driven through vLLM"
    if not config.full_layer_ids:
        return "an all-SWA model (no full-attention layers) is not driven through vLLM's manager yet"
    return None


def refuse_run_options(family: str, faults, backup_mode) -> None:
    """What both vLLM families refuse of a run: catalogue faults and a backup mode other than recompute."""
    if tuple(faults):
        raise ConfigError(f"the {family} family runs vLLM's code as shipped: it has no catalogue faults")
    if backup_mode not in (None, "cpu_tensor"):
        raise ConfigError(f"the {family} family has no backup_mode {backup_mode!r}: vLLM recomputes a preempted "
                          "request (cpu_tensor is the only path the harness names for it)")


def manager_unsupported_reason(config: ModelConfig) -> str | None:
    """Why ``vllm:manager`` does not drive ``config``: what the installed vLLM cannot run (``unsupported_reason``,
    which ``--family vllm`` shares), and a mamba "align" config, whose prefill chunk ends, resumed prefill
    lengths and cached states only vLLM's scheduler decides (``--family vllm`` runs it)."""
    reason = unsupported_reason(config)
    if reason is None and config.has_mamba and mamba_mode_for(config) == "align":
        reason = ('mamba cache mode "align" is driven only through vLLM\'s own Scheduler, which decides where its '
                  "prefill chunks end and which cached state a request continues from: run it with --family vllm")
    return reason


def build_vllm_family(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> VllmFamily:
    """The ``vllm:manager`` family over ``config`` (a ConfigError naming the reason where it declines it)."""
    refuse_run_options("vllm:manager", faults, backup_mode)
    api = load()
    reason = manager_unsupported_reason(config)
    if reason:
        raise ConfigError(f"vllm:manager cannot build {config.name!r}: {reason}")
    mode = mamba_mode_for(config)
    built = build_manager(api, config, mode)
    return VllmFamily(api=api, config=config, device=torch.device(device), built=built, mamba_mode=mode,
                      uses_ssm_state=uses_ssm_state(config))
