"""The family builder: the pools of one config, wired as SGLang wires them, with optional faults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from poolfuzz.pools.allocator import FreeListener, TokenAllocator
from poolfuzz.pools.attention_kinds import kind_of
from poolfuzz.pools.capabilities import PoolsOrigin
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.host import HostKVPool
from poolfuzz.pools.kv import KVCache, MHATokenToKVPool
from poolfuzz.pools.prefix_tree import MambaPrefixTree
from poolfuzz.pools.protocol import ServingProtocol
from poolfuzz.pools.req_to_token import ReqToTokenPool
from poolfuzz.pools.pure_swa import PureSWATokenAllocator
from poolfuzz.pools.swa_allocator import SWATokenAllocator
from poolfuzz.pools.faults import blueprint_with, required_backup_mode
from poolfuzz.pools.transfer import PDTransfer

BACKUP_MODES = ("cpu_tensor", "host_pool")


@dataclass(kw_only=True)
class PoolFamily:
    """Every pool of one serving node for one model, and the protocol that drives them.

    ``supports_next_turn``: False; a finished request's tokens are not kept for a next turn (its
    prefix hit is what ``fork`` models here, from a running request).
    ``supports_tree_drafts``: every KV pool here moves accepted rows (``move_kv_cache``).
    ``pools_origin``: poolfuzz built them (no engine code runs)."""

    supports_next_turn = False
    supports_tree_drafts = True
    pools_origin = PoolsOrigin(built_by="poolfuzz", detail="poolfuzz's own pools, with SGLang's semantics")

    config: ModelConfig
    device: torch.device
    faults: tuple[str, ...]
    req_pool: ReqToTokenPool
    kv_pool: KVCache
    allocator: TokenAllocator | SWATokenAllocator | PureSWATokenAllocator
    backup_mode: str
    host_pools: dict[str, HostKVPool] = field(default_factory=dict)
    protocol: ServingProtocol = field(default_factory=ServingProtocol)
    transfer: PDTransfer = field(default_factory=PDTransfer)
    uses_ssm_state: bool = False
    # The prefix cache's recurrent-state checkpoints (radix match + copy-on-write), or None.
    prefix_tree: MambaPrefixTree | None = None

    def __repr__(self) -> str:
        faults = f", faults={list(self.faults)}" if self.faults else ""
        return f"PoolFamily({self.config.name}, {self.device}, {self.backup_mode}{faults})"

    # --- what the harness reads -------------------------------------------------------------
    def components(self) -> list[Component]:
        """Every device buffer a request's state lives in, each addressed by one index space."""
        out = list(self.kv_pool.components())
        if self.req_pool.mamba_pool is not None:
            out += self.req_pool.mamba_pool.components()
            scratch = self.req_pool.mamba_pool.spec_scratch
            if scratch is not None:
                out += scratch.components()
        return out

    def host_components(self) -> list[Component]:
        return [c for pool in self.host_pools.values() for c in pool.components()]

    def has_recurrent_state(self) -> bool:
        return self.req_pool.mamba_pool is not None

    def host_device_pool(self, space: str) -> MHATokenToKVPool:
        """The device sub-pool a host pool mirrors."""
        if space == "host.swa":
            return self.kv_pool.swa_kv_pool
        return getattr(self.kv_pool, "full_kv_pool", self.kv_pool)

    def copy_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy full KV rows, and SWA rows where the source is mapped (a radix prefix hit)."""
        for comp in self.kv_pool.components():
            if comp.space == "full":
                comp.tensor[comp.at(dst_slots.to(self.device))] = comp.tensor[comp.at(src_slots.to(self.device))]
        if self.config.has_swa:
            s, d = self.allocator.translate(src_slots), self.allocator.translate(dst_slots)
            live = (s > 0) & (d > 0)
            for comp in self.kv_pool.components():
                if comp.space == "swa":
                    comp.tensor[d[live].to(self.device)] = comp.tensor[s[live].to(self.device)]

    def free_lists(self) -> dict[str, object]:
        """Every allocator by index space: rows, full, (swa), (mamba), host.*."""
        out: dict[str, object] = {"rows": self.req_pool.rows}
        out.update(self.allocator.sub_allocators())
        if self.req_pool.mamba_pool is not None:
            out["mamba"] = self.req_pool.mamba_allocator
        out.update(self.host_pools)
        return out

    def set_free_listener(self, listener: FreeListener | None) -> None:
        """Call ``listener(space, slots)`` after every free in every pool (the harness poisons them)."""
        for pool in self.free_lists().values():
            pool.on_free = listener

    def cached_units(self) -> dict[str, list[int]]:
        """Units the prefix cache holds (no request does), by index space."""
        return {"mamba": self.prefix_tree.held_slots()} if self.prefix_tree is not None else {}

    def flush_prefix_cache(self) -> None:
        """Evict every unlocked prefix-cache entry (what an idle server may do at any time)."""
        if self.prefix_tree is not None:
            self.prefix_tree.flush()

    def flush_cache(self) -> None:
        """An idle server's ``Scheduler.flush_cache`` (as after a weight update): the prefix tree is reset,
        its checkpoints dropped rather than freed, then the request rows (with their mamba slots and
        mappings) and every token allocator are reset in place."""
        dropped = self.prefix_tree.reset() if self.prefix_tree is not None else []
        self.req_pool.clear()
        self.allocator.clear()
        listener = self.free_lists().get("mamba")
        if dropped and listener is not None and listener.on_free is not None:  # free now: poisoned
            listener.on_free("mamba", torch.as_tensor(dropped, dtype=torch.int64))


def resolve_backup_mode(config: ModelConfig, kv_pool_cls: type, predicate) -> str:
    """host_pool iff the model keeps no recurrent state and the KV pool has host entries."""
    if not predicate(config) and kv_pool_cls.supports_host_pool_backup:
        return "host_pool"
    return "cpu_tensor"


def resolved_backup_mode(config: ModelConfig, faults: Iterable[str] = (), backup_mode: str | None = None) -> str:
    """The retraction path the built-in family of ``config`` with ``faults`` runs: resolved from the
    blueprint alone, without building a pool (``build_family`` uses this same answer)."""
    faults = tuple(faults)
    bp = blueprint_with(faults, config)
    resolved = (bp.backup_resolver or resolve_backup_mode)(config, bp.kv_pool_class(config), bp.ssm_predicate)
    if backup_mode is None:
        # A fault that lives on one retraction path (e.g. SWAKVPool.load_cpu_copy) selects it.
        return required_backup_mode(faults) or resolved
    if backup_mode not in BACKUP_MODES:
        raise ConfigError(f"unknown backup mode {backup_mode!r}; choose one of {', '.join(BACKUP_MODES)}")
    if backup_mode == "host_pool" and resolved != "host_pool":
        raise ConfigError(
            f"config {config.name!r}: host_pool retraction backup cannot carry recurrent state or this "
            "KV pool's components; use backup_mode='cpu_tensor' (or leave it unset)"
        )
    return backup_mode


def expected_backup_mode(config: ModelConfig, faults: Iterable[str] = (), backup_mode: str | None = None,
                         family_factory=None, *, fallback: str = "cpu_tensor") -> str:
    """The backup mode a family would run, without building one (for reports where none was built):
    the built-in family's resolution, what was asked of a plug-in (it resolves its own), or
    ``fallback`` for an impossible combination (building the family reports that)."""
    if family_factory is not None and family_factory is not build_family:
        return backup_mode or fallback
    try:
        return resolved_backup_mode(config, faults, backup_mode)
    except ConfigError:
        return backup_mode or fallback


def resolve_device(device) -> torch.device:
    """``auto`` is CUDA when present, else CPU; an unusable device is a ConfigError with the fix."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for but no CUDA GPU is visible; "
                              "use --device cpu (or auto) on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise ConfigError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    return dev


def build_family(config: ModelConfig, *, device="cpu", faults: Iterable[str] = (),
                 backup_mode: str | None = None) -> PoolFamily:
    """The pools for ``config`` on ``device``, correct unless ``faults`` name catalogue entries."""
    dev = resolve_device(device)
    faults = tuple(faults)
    bp = blueprint_with(faults, config)
    c = config
    mamba_pool = None
    if c.has_mamba:
        mamba_pool = bp.mamba_pool(size=c.mamba_slots, num_layers=c.mamba_layers, conv_shapes=c.conv_shapes,
                                   temporal_shape=c.temporal_shape, dtype=c.state_dtype, device=dev,
                                   layer_ids=c.mamba_layer_ids)
        if c.spec_draft_tokens:
            mamba_pool.spec_scratch = bp.spec_scratch(rows=c.request_rows, draft_tokens=c.spec_draft_tokens,
                                                      mamba_pool=mamba_pool)
        req_pool = bp.hybrid_req_pool(size=c.request_rows, max_context=c.max_context, device=dev,
                                      mamba_pool=mamba_pool, mamba_allocator_cls=bp.mamba_allocator)
    else:
        req_pool = bp.req_pool(size=c.request_rows, max_context=c.max_context, device=dev)
    kv_args = dict(page_size=c.page_size, dtype=c.kv_dtype, head_num=c.head_num, head_dim=c.head_dim, device=dev)
    if c.kv_scale_block:
        kv_args["scale_block"] = c.kv_scale_block
    kind = kind_of(c)
    if c.has_swa and not c.has_full:  # all-SWA: the window's slots are the only token slots
        kv_pool = bp.pure_swa_kv_pool(size=0, size_swa=c.swa_tokens, full_layer_ids=(), swa_layer_ids=c.swa_layer_ids,
                                      kv_class=bp.token_kv_pool(c), **kv_args)
        allocator = bp.pure_swa_allocator(size_swa=c.swa_tokens, page_size=c.page_size)
        kv_pool.register_mapping(allocator.full_to_swa)
    elif c.has_swa:
        kv_pool = bp.swa_kv_pool(size=c.full_tokens, size_swa=c.swa_tokens, full_layer_ids=c.full_layer_ids,
                                 swa_layer_ids=c.swa_layer_ids, kv_class=bp.token_kv_pool(c), **kv_args)
        allocator = bp.swa_allocator(size=c.full_tokens, size_swa=c.swa_tokens, page_size=c.page_size)
        kv_pool.register_mapping(allocator.full_to_swa)
    elif c.has_mamba:
        kv_pool = bp.hybrid_kv_pool(size=c.full_tokens, full_layer_ids=c.full_layer_ids, mamba_pool=mamba_pool,
                                    kv_class=bp.hybrid_full_pool(c), **kind.pool_args(c), **kv_args)
        allocator = bp.token_allocator(size=c.full_tokens, page_size=c.page_size)
    else:  # full attention only: the attention kind's pool (MHA, MLA, DSA, MiniMax sparse)
        token_pool = dict(kv_class=bp.token_kv_pool(c)) if kind.holds_token_pool else {}
        kv_pool = bp.full_attention_pool(c)(size=c.full_tokens, layer_ids=c.full_layer_ids, **kind.pool_args(c),
                                            **token_pool, **kv_args)
        allocator = bp.token_allocator(size=c.full_tokens, page_size=c.page_size)

    backup_mode = resolved_backup_mode(c, faults, backup_mode)
    host_pools = {}
    if backup_mode == "host_pool":
        full = getattr(kv_pool, "full_kv_pool", kv_pool)
        host_pools["host.full"] = bp.host_pool(device_pool=full, size=c.host_size, page_size=c.page_size,
                                               space="host.full")
        if c.has_swa:
            host_pools["host.swa"] = bp.host_pool(device_pool=kv_pool.swa_kv_pool, size=c.host_size,
                                                  page_size=c.page_size, space="host.swa")
    return PoolFamily(config=c, device=dev, faults=faults, req_pool=req_pool, kv_pool=kv_pool,
                      allocator=allocator, backup_mode=backup_mode, host_pools=host_pools,
                      protocol=bp.protocol(), transfer=bp.transfer(),
                      uses_ssm_state=bp.ssm_predicate(c),
                      prefix_tree=bp.prefix_tree(req_pool.mamba_allocator) if c.has_mamba else None)


# What ``poolfuzz run --coverage`` measures for this family (relative to the directory holding ``poolfuzz``).
build_family.engine_code = ("poolfuzz/pools",)
