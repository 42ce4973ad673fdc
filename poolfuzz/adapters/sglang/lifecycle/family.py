"""A pool family built from SGLang's real pools, seen through thin views the harness reads.

Every tensor the harness checksums is SGLang's own buffer (``k_buffer[l]``, ``v_buffer[l]``,
the MambaPool's conv and temporal state); every free list is read from SGLang's allocator
objects. The views only translate: ids to Python ints, ``None`` to typed errors, and free
lists to the ``available_size`` / ``is_free_page`` / ``free_pages`` queries of
:class:`poolfuzz.pools.family.PoolFamily`.

SGLang's allocators have no free callback. After every protocol operation the family diffs
each free list against the last one it saw and tells the harness's listener which slots were
freed, so the harness can poison them before anything reuses them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from poolfuzz.adapters.sglang.lifecycle.admission import SchedulerAdmission
from poolfuzz.adapters.sglang.api import SGLangAPI, construct, load
from poolfuzz.adapters.sglang.pools.calls import native_kv_move, paged_alloc_extend
from poolfuzz.adapters.sglang.pools.descriptions import describe_pools, same_pools
from poolfuzz.adapters.sglang.lifecycle.frees import debug_memory_pool
from poolfuzz.adapters.sglang.host_tier.host import SGLangHostBackup, host_pool_problem, resolve_backup_mode
from poolfuzz.adapters.sglang.pools.hybrid_mla import build_hybrid_mla_pool, hybrid_mla_problem
from poolfuzz.adapters.sglang.pools.minimax import write_msa_rows
from poolfuzz.adapters.sglang.disaggregation.pd import SGLangPDTransfer, pd_problem, registration
from poolfuzz.adapters.sglang.disaggregation.prealloc import DECODE, gate_problem
from poolfuzz.adapters.sglang.lifecycle.protocol import SGLangProtocol
from poolfuzz.adapters.sglang.pools.reads import read_door, stored_bytes
from poolfuzz.adapters.sglang.pools.request_pool import (build_plain_request_pool, build_request_pool, check_built, rows_over_slots,
                                                       server_row_width)
from poolfuzz.adapters.sglang.lifecycle.standin import standin_class
from poolfuzz.adapters.sglang.pools.storage import (build_storage_pool, quant_method_kwargs, storage_of,
                                                     storage_problem)
from poolfuzz.adapters.sglang.lifecycle.speculative import (
    SGLangScratch, move_problem, speculative_problem,
)
from poolfuzz.adapters.sglang.pools.writes import write_rows
from poolfuzz.adapters.sglang.lifecycle.tracking import extra_buffer_admission_problem, extra_buffer_problem
from poolfuzz.adapters.sglang.pools.views import (AllocatorView, FreeListView, KVPoolView, MambaPoolView, ReqPoolView,
                                            as_ints, token_free_pages,
                                            token_free_sources)
from poolfuzz.pools.capabilities import PoolsOrigin
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import resolve_device
from poolfuzz.pools.quantised import MODEL_DTYPE

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# =============================================================================================
# The family
# =============================================================================================
@dataclass(kw_only=True)
class SGLangFamily:
    """The pools of one serving node for one model, built by the installed SGLang.

    Capabilities the harness's state machine reads:
      ``supports_fork``: False here (a chunk cache); :class:`~poolfuzz.adapters.sglang.tree.trees.SGLangTreeFamily`
      puts SGLang's own prefix tree in front of the pools and forks through it, where it drives the config.
      ``supports_transfer``: PD transfer over SGLang's own PD registration (``adapters.sglang.pd``),
      where the release has it; False (per family) where it does not.
      ``resume_swa_tail_only``: a paged SWA resume allocates SWA for the window tail only, where the
        release's SWA allocator has ``alloc_extend_swa_tail`` (set per release when built).
      ``pd_decode``: this node is SGLang's PD decode server (the engine's decode node): its allocators are
        built with ``need_sort`` as ``disaggregation_mode="decode"`` builds them, and every pre-allocation
        (a transfer's, a resume's) first passes the decode queue's gate (``adapters.sglang.prealloc``), where
        the release has one. The prefill node is a colocated server that also sends requests.
      ``supports_retract``: False where SGLang's own PD setup (``setup_state_kv_args``) refuses the KV pool: SGLang
        backs a request's KV up at retraction only on a PD decode server (``release_req``), which then cannot
        exist, and a colocated server recomputes a retracted request instead (``declined`` says why).
      ``pools_origin``: the engine's where SGLang's own configurator built the pools for the config's server
        (``served``), the adapter's wiring otherwise; ``pools_source`` says which server, or why.
      ``supports_tree_drafts``: a tree verify's accepted KV moves through the KV pool's own ``move_kv_cache``
        (``adapters.sglang.speculative.move_accepted``); False (per family) where the built pool cannot move
        a row on this machine.
    """

    supports_fork = False
    supports_tree_drafts = True
    supports_transfer = True
    supports_retract = True
    resume_swa_tail_only = True
    pd_decode = False

    api: SGLangAPI
    config: ModelConfig
    device: torch.device
    faults: tuple[str, ...] = ()
    backup_mode: str = "cpu_tensor"
    uses_ssm_state: bool = False
    sg_req_pool: object = None
    sg_kv_pool: object = None
    sg_allocator: object = None
    req_pool: ReqPoolView = None
    kv_pool: KVPoolView = None
    allocator: AllocatorView = None
    protocol: object = None
    admission: object = None  # SGLang's own admission and capacity checks (adapters.sglang.admission)
    transfer: object = None
    host_pools: dict = field(default_factory=dict)  # host_pool mode: space -> HostFreeListView
    host_backup: object = None  # host_pool mode: SGLang's host-pool retraction (adapters.sglang.host)
    standin_cls: type = None
    # Backups whose tensors aliased a live pool buffer and were copied (CPU only; see protocol).
    cpu_aliases: list = field(default_factory=list)
    declined: dict = field(default_factory=dict)  # operation -> the engine's reason it is not driven
    # who built the pools: SGLang's KV cache configurator for the config's server, or the adapter's wiring and why
    pools_source: str = "the adapter's wiring"
    # what SGLang's configurator built and sized, where the family runs on it (``configurator.ConfiguredPools``)
    served: object = None
    _free_views: dict = field(default_factory=dict)
    _last_free: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"SGLangFamily({self.config.name}, sglang {self.api.version}, {self.device}, {self.backup_mode})"

    # --- what the harness reads ----------------------------------------------------------------
    def components(self) -> list[Component]:
        out = self.kv_pool.components()
        if self.req_pool.mamba_pool is not None:
            out += self.req_pool.mamba_pool.components()
            if self.req_pool.mamba_pool.spec_scratch is not None:
                out += self.req_pool.mamba_pool.spec_scratch.components()
        return out

    def host_components(self) -> list[Component]:
        return [c for view in self.host_pools.values() for c in view.components()]

    def has_recurrent_state(self) -> bool:
        return self.req_pool.mamba_pool is not None

    @property
    def pools_origin(self) -> PoolsOrigin:
        """SGLang's own code built the pools where its configurator served the config's server, else the adapter."""
        return PoolsOrigin(built_by="adapter" if self.served is None else "engine", detail=self.pools_source)

    def free_lists(self) -> dict[str, FreeListView]:
        return dict(self._free_views)

    def set_free_listener(self, listener) -> None:
        for view in self._free_views.values():
            view.on_free = listener
        self.snapshot_free_lists()

    # --- free notification by diffing ---------------------------------------------------------
    def snapshot_free_lists(self) -> None:
        self._last_free = {space: set(v.free_pages()) for space, v in self._free_views.items()}

    def notify_frees(self) -> None:
        """Tell each view's listener which units became free since the last snapshot."""
        for space, view in self._free_views.items():
            now = set(view.free_pages())
            freed = now - self._last_free.get(space, set())
            self._last_free[space] = now
            if freed and view.on_free is not None:
                view.on_free(space, view.slots_of(sorted(freed)))

    def flush_prefix_cache(self) -> None:
        """The drain (every request of the node ended): without a prefix cache, the idle server's flush."""
        self.flush_cache()

    def flush_cache(self) -> None:
        """The idle server's ``Scheduler.flush_cache`` (as after a weight update): SGLang resets its pools in
        place, the request rows with their mamba slots and mappings, then every token allocator; the engine
        then checks that every pool is whole, and serves on."""
        self.sg_req_pool.clear()
        self.sg_allocator.clear()
        reset = getattr(self.sg_req_pool, "reset_aux_cache_allocator", None)
        if reset is not None:
            reset()
        self.notify_frees()

    # --- helpers the protocol uses ------------------------------------------------------------
    def space_short_of(self, needs: dict[str, int], evictable: dict[str, int] | None = None
                       ) -> tuple[str, int, int] | None:
        """The first space (in the harness's order) without ``needs[space]`` free units, counting the
        tokens a prefix tree could evict for it (``evictable``, by space) as free."""
        for space, units in needs.items():
            view = self._free_views.get(space)
            if view is None:  # an all-SWA model has no full space: its SWA need is the same count
                continue
            have = (view.available_size() + (evictable or {}).get(space, 0)) // view.page_size
            if units > have:
                return space, units * view.page_size, view.available_size()
        return None


def unsupported_reason(config: ModelConfig, *, scheduled: bool = False) -> str | None:
    """Why the installed SGLang cannot run ``config`` here, or None. Probes, never versions. ``scheduled``: for the
    scheduler path, which admits requests through SGLang's own scheduler (the adapter's admission limits do not
    apply)."""
    api = load()
    if not scheduled:  # the scheduler path publishes its server itself, and SGLang refuses it there
        from poolfuzz.adapters.sglang.pools import configurator

        refused = configurator.refusal(config)
        if refused:
            return refused
        if config.free_memory_kib:  # only SGLang sizes such a server: where it does not here, nothing runs
            try:
                configurator.server_sized(config)
            except ConfigError as exc:
                return str(exc)
    if not scheduled and extra_buffer_admission_problem(api, config):
        return extra_buffer_admission_problem(api, config)
    if config.has_swa and not config.has_full and api.PureSWATokenToKVPoolAllocator is None:
        return (f"SGLang {api.version} has no PureSWATokenToKVPoolAllocator: it builds no pools for an all-SWA "
                "model (every layer sliding-window; full_layers = 0)")
    if config.page_size > 1:
        problem = _paged_allocation_problem(api)
        if problem:
            return problem
    if config.latent and config.has_mamba:
        return extra_buffer_problem(api, config) or speculative_problem(api, config) or hybrid_mla_problem(api, config)
    return (extra_buffer_problem(api, config) or speculative_problem(api, config)
            or storage_problem(api, config, scheduled=scheduled))


_PAGED_PROBE: dict[str, str | None] = {}


def _paged_allocation_problem(api: SGLangAPI) -> str | None:
    """Try one paged allocation on a throwaway allocator: some releases always launch a Triton
    kernel for it, which cannot run without a GPU."""
    if "result" in _PAGED_PROBE:
        return _PAGED_PROBE["result"]
    problem = None
    try:
        kv = construct(api.MHATokenToKVPool, size=8, page_size=4, dtype=torch.float32, head_num=1, head_dim=4,
                       layer_num=1, device="cpu", enable_memory_saver=False)
        alloc = construct(api.PagedTokenToKVPoolAllocator, size=8, page_size=4, dtype=torch.float32, device="cpu",
                          kvcache=kv, need_sort=False)
        out = paged_alloc_extend(alloc, prefix_len=0, seq_len=3, last_loc=-1)
        if out is None or as_ints(out) != [4, 5, 6]:
            problem = f"paged alloc_extend gave {out!r} on an empty pool"
    except Exception as exc:  # a Triton launch without a GPU raises one of many types
        problem = (f"SGLang {api.version}'s paged allocator cannot allocate on this device "
                   f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                   "use a page-size-1 config")
    _PAGED_PROBE["result"] = problem
    return problem


def build_sglang_family(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None,
                        node: str | None = None, scheduled: bool = False,
                        decode_rows: int | None = None, role_flags: dict | None = None,
                        listing: str = "sglang:pools") -> SGLangFamily:
    """``listing``: the family whose ``poolfuzz configs --family`` listing shows SGLang's pools beside the wiring's,
    as a message on the wiring names it. ``role_flags``: the server flags of the role a scheduler-path server plays
    (its decode server's), with which SGLang's configurator builds its pools. ``decode_rows``: the request pool is a
    PD decode server's, with that many rows more for requests in pre-allocation and transfer (the scheduler path's
    decode server; the pools path's decode node keeps the plain pool it drives)."""
    faults = tuple(faults)
    if faults:
        raise ConfigError(f"the sglang family runs SGLang's own code; catalogue faults {list(faults)} "
                          "only apply to the builtin family (drop --faults, or use --family builtin)")
    if backup_mode not in (None, "cpu_tensor", "host_pool"):
        raise ConfigError(f"unknown backup mode {backup_mode!r}; choose cpu_tensor or host_pool")
    api = load()
    reason = unsupported_reason(config, scheduled=scheduled)
    if reason:
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: {reason}")
    if backup_mode == "host_pool" and host_pool_problem(api, config):
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: no host_pool retraction backup: "
                          f"{host_pool_problem(api, config)} (use backup_mode cpu_tensor, or leave it unset)")
    # Unset: what SGLang's decode server infers from its KV pool (resolve_decode_retraction_backup).
    backup_mode = backup_mode or resolve_backup_mode(api, config)
    dev = resolve_device(device)
    sdev = str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    try:
        with debug_memory_pool(), native_kv_move():
            pd_decode = node == DECODE or decode_rows is not None
            build = functools.partial(_build, api, config, dev, sdev, backup_mode, pd_decode=pd_decode,
                                      scheduled=scheduled, decode_rows=decode_rows)
            family = served_or_wired(build, config, sdev, pd_decode=pd_decode, role_flags=role_flags,
                                     listing=listing)
            rows = rows_over_slots(family.sg_req_pool)
            if rows:  # as the release's servers size it: a state slot for every row
                return build_sglang_family(config.replace(mamba_slots=rows), device=device, faults=faults,
                                           backup_mode=backup_mode, node=node, scheduled=scheduled,
                                           decode_rows=decode_rows, role_flags=role_flags, listing=listing)
            return family
    except ConfigError:
        raise  # declined already, with its reason (a server SGLang refuses among them)
    except (AssertionError, ValueError) as exc:
        # SGLang's constructors decide what this release can build: a config they refuse is
        # declined (a drawn one is skipped), never reported as a bug found in the pools.
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: SGLang's constructors refuse it "
                          f"({type(exc).__name__}: {first})") from None


# (config, its role flags, decode node, device) -> None where SGLang's configurator serves the config's pools, else why
# the family keeps its wiring: decided by the first build (a family is built for every example; the release does not
# change under a run), so later builds neither build the wiring only to compare it nor ask a refusing server again.
_SERVES: dict[tuple, str | None] = {}


def served_or_wired(build, config: ModelConfig, sdev: str, *, pd_decode: bool, role_flags: dict | None,
                    same=None, listing: str = "sglang:pools"):
    """The family over the pools SGLang's configurator builds for the config's server where they are the config's
    (``_server_pools``; ``same``: how the two builds' descriptions must agree, ``descriptions.same_pools`` by
    default), else over the adapter's wiring (``build``: the family's builder with all but ``served`` given).
    ``listing``: the family whose ``poolfuzz configs --family`` listing shows the two builds."""
    from poolfuzz.adapters.sglang.pools import configurator

    key = (config, tuple(sorted((role_flags or {}).items())), pd_decode, sdev)
    if key not in _SERVES:
        family = build()
        served = _server_pools(config, family, sdev, pd_decode=pd_decode, role_flags=role_flags,
                               same=same or same_pools, listing=listing)
        _SERVES[key] = None if served is not None else family.pools_source
        if served is None:
            return family
    elif _SERVES[key] is not None:
        family = build()
        family.pools_source = _SERVES[key]
        return family
    else:
        try:
            served = configurator.configure(config, device=sdev, role_flags=role_flags)
        except ConfigError as exc:  # refused now where it built before: the wiring, with the reason
            family = build()
            family.pools_source = f"the adapter's wiring ({exc})"
            return family
    family = build(served=served)
    family.pools_source = f"{configurator.builder()} ({served.server.command_line()})"
    family.served = served
    return family


def _server_pools(config: ModelConfig, family: SGLangFamily, sdev: str, *, pd_decode: bool,
                  role_flags: dict | None = None, same, listing: str):
    """The pools SGLang's own KV cache configurator builds for the config's server (``pools/configurator.py``), where
    it builds them here and they are the pools the config describes: the classes, sizes, mamba shapes and layers of
    the family's own wiring, the request rows' width aside. None otherwise, and ``family.pools_source`` says why the
    family keeps its wiring (``poolfuzz configs --family sglang:pools`` shows how the two differ)."""
    from poolfuzz.adapters.sglang.pools import configurator

    if pd_decode and not role_flags:
        family.pools_source = ("the adapter's wiring (the pools path's decode node: its server flags are not the "
                               "scheduler path's decode server's)")
        return None
    try:
        served = configurator.configure(config, device=sdev, role_flags=role_flags)
    except configurator.ServerRefused:
        raise  # no such server starts: the config is declined, with SGLang's words
    except ConfigError as exc:
        family.pools_source = f"the adapter's wiring ({exc})"
        return None
    if not same(served.parts(), describe_pools(family.sg_req_pool, family.sg_kv_pool, family.sg_allocator)):
        family.pools_source = (f"the adapter's wiring ({configurator.builder()} builds other pools for the config's "
                               f"server; poolfuzz configs --family {listing} shows them)")
        return None
    return served


def _take(served, role: str, build):
    """The server's own pool for ``role`` where SGLang's configurator built this config's pools, else ``build()``."""
    return build() if served is None else getattr(served, role)


def _build(api: SGLangAPI, config: ModelConfig, dev, sdev: str, backup_mode: str = "cpu_tensor",
           pd_decode: bool = False, scheduled: bool = False, decode_rows: int | None = None,
           served=None) -> SGLangFamily:
    """The family over the config's pools: the adapter's wiring of them, or, with ``served``, the ones SGLang's own
    configurator built for the config's server (the same classes and sizes, checked by ``_server_pools``)."""
    c = config
    need_sort = pd_decode  # the configurator's need_sort: disaggregation_mode in ("decode", "prefill")
    kv_dtype = KV_DTYPES[c.kv_dtype]
    # enable_kvcache_transpose (required by SWAKVPool / HybridLinearKVPool in some releases, which
    # assert it False): False asks for the standard [slots, heads, head_dim] layout poolfuzz reads.
    common = dict(page_size=c.page_size, dtype=kv_dtype, head_num=c.head_num, head_dim=c.head_dim, device=sdev,
                  enable_memory_saver=False, enable_kvcache_transpose=False)

    mamba_view = None
    # a scheduled server's rows are as wide as its configurator makes them (its flags are published by then)
    width = (lambda: server_row_width(c)) if scheduled else (lambda: None)
    if c.has_mamba:
        sg_req_pool = _take(served, "req_to_token_pool",
                            lambda: build_request_pool(api, c, sdev, decode_rows=decode_rows, width=width()))
        problem = check_built(sg_req_pool, c)
        if problem:
            raise ConfigError(f"config {c.name!r} on sglang {api.version}: {problem}")
        mamba_view = MambaPoolView(sg_req_pool.mamba_pool, c.mamba_layer_ids, req_pool=sg_req_pool)
        if c.spec_draft_tokens:
            mamba_view.spec_scratch = SGLangScratch(sg_req_pool, layer_ids=c.mamba_layer_ids,
                                                    draft_tokens=c.spec_draft_tokens)
    else:
        sg_req_pool = _take(served, "req_to_token_pool",
                            lambda: build_plain_request_pool(api, c, sdev, decode_rows=decode_rows, width=width()))

    comps: list[Component] = []
    if not c.has_mamba and (storage_of(c).own_pool or c.kv_scale_block or c.kv_quant == "fp4_mx_block16"):
        sg_kv, comps = build_storage_pool(api, c, common, scheduled=scheduled,
                                          pool=None if served is None else served.token_to_kv_pool)
        alloc_cls = api.TokenToKVPoolAllocator if c.page_size == 1 else api.PagedTokenToKVPoolAllocator
        sg_alloc = _take(served, "allocator", lambda: construct(
            alloc_cls, size=c.full_tokens, page_size=c.page_size, dtype=kv_dtype, device=sdev, kvcache=sg_kv,
            need_sort=need_sort))
        subs = {"full": sg_alloc}
    elif c.has_swa and not c.has_full:  # all-SWA: as kv_cache_configurator builds it (no full side)
        sg_kv = _take(served, "token_to_kv_pool", lambda: construct(
            api.SWAKVPool, size=0, size_swa=c.swa_tokens, swa_attention_layer_ids=list(c.swa_layer_ids),
            full_attention_layer_ids=[], token_to_kv_pool_class=api.MHATokenToKVPool, **common))
        sg_alloc = _take(served, "allocator", lambda: construct(
            api.PureSWATokenToKVPoolAllocator, size_swa=c.swa_tokens, page_size=c.page_size, dtype=kv_dtype,
            device=sdev, kvcache=sg_kv, need_sort=need_sort))
        comps += _mha_components(sg_kv.swa_kv_pool, c.swa_layer_ids, "swa", door=sg_kv)
        subs = {"swa": sg_alloc.swa_attn_allocator}
    elif c.has_swa:
        sg_kv = _take(served, "token_to_kv_pool", lambda: construct(
            api.SWAKVPool, size=c.full_tokens, size_swa=c.swa_tokens, swa_attention_layer_ids=list(c.swa_layer_ids),
            full_attention_layer_ids=list(c.full_layer_ids), token_to_kv_pool_class=api.MHATokenToKVPool, **common))
        sg_alloc = _take(served, "allocator", lambda: construct(
            api.SWATokenToKVPoolAllocator, size=c.full_tokens, size_swa=c.swa_tokens, page_size=c.page_size,
            dtype=kv_dtype, device=sdev, kvcache=sg_kv, need_sort=need_sort, req_to_token_pool=sg_req_pool))
        if getattr(sg_kv, "full_to_swa_index_mapping", None) is None:
            sg_kv.register_mapping(sg_alloc.full_to_swa_index_mapping)
        comps += _mha_components(sg_kv.full_kv_pool, c.full_layer_ids, "full", door=sg_kv)
        comps += _mha_components(sg_kv.swa_kv_pool, c.swa_layer_ids, "swa", door=sg_kv)
        subs = {"full": sg_alloc.full_attn_allocator, "swa": sg_alloc.swa_attn_allocator}
    elif c.latent:  # Kimi-Linear: MLA layers between recurrent ones (adapters.sglang.hybrid_mla)
        sg_kv, comps = build_hybrid_mla_pool(api, c, sg_req_pool.mamba_pool, common)
        alloc_cls = api.TokenToKVPoolAllocator if c.page_size == 1 else api.PagedTokenToKVPoolAllocator
        sg_alloc = construct(alloc_cls, size=c.full_tokens, page_size=c.page_size, dtype=kv_dtype, device=sdev,
                             kvcache=sg_kv, need_sort=need_sort)
        subs = {"full": sg_alloc}
    else:
        if c.has_mamba:
            sg_kv = _take(served, "token_to_kv_pool", lambda: construct(
                api.HybridLinearKVPool, size=c.full_tokens, full_attention_layer_ids=list(c.full_layer_ids),
                mamba_pool=sg_req_pool.mamba_pool, use_mla=False, **common))
            full_pool = sg_kv.full_kv_pool
        else:
            sg_kv = _take(served, "token_to_kv_pool", lambda: construct(
                api.MHATokenToKVPool, size=c.full_tokens, layer_num=c.full_layers, **common,
                **quant_method_kwargs(api, c)))
            full_pool = sg_kv
        comps += _mha_components(full_pool, c.full_layer_ids, "full", door=sg_kv)
        alloc_cls = api.TokenToKVPoolAllocator if c.page_size == 1 else api.PagedTokenToKVPoolAllocator
        sg_alloc = _take(served, "allocator", lambda: construct(
            alloc_cls, size=c.full_tokens, page_size=c.page_size, dtype=kv_dtype, device=sdev, kvcache=sg_kv,
            need_sort=need_sort))
        subs = {"full": sg_alloc}

    views: dict[str, FreeListView] = {
        "rows": FreeListView(space="rows", owner=sg_req_pool, read=lambda: as_ints(sg_req_pool.free_slots),
                             available=sg_req_pool.available_size)}
    for space, sub in subs.items():
        views[space] = FreeListView(space=space, owner=sub, read=lambda s=sub: token_free_pages(s),
                                    available=sub.available_size, page_size=c.page_size,
                                    sources=lambda s=sub: token_free_sources(s))
    mamba_free = None
    if c.has_mamba:
        owner = getattr(sg_req_pool, "mamba_allocator", None) or sg_req_pool.mamba_pool
        mamba_free = FreeListView(space="mamba", owner=owner, read=lambda o=owner: as_ints(o.free_slots),
                                  available=owner.available_size)
        views["mamba"] = mamba_free

    carries, declared = carries_mamba(api, sg_kv)
    door, verified_door = _write_doors(sg_kv, c)
    view_cls = type(type(sg_kv).__name__, (KVPoolView,),
                    {"cpu_copy_carries_mamba": carries, "declared": declared, "__module__": __name__})
    family = SGLangFamily(
        api=api, config=c, device=dev, uses_ssm_state=uses_ssm_state(c), sg_req_pool=sg_req_pool,
        sg_kv_pool=sg_kv, sg_allocator=sg_alloc,
        req_pool=ReqPoolView(sg_req_pool, mamba=mamba_view, rows=views["rows"], mamba_free=mamba_free),
        kv_pool=view_cls(sg_kv, comps, door=door, verified_door=verified_door), allocator=AllocatorView(sg_alloc, swa=c.has_swa),
        protocol=SGLangProtocol(), standin_cls=standin_class(api), admission=SchedulerAdmission(api))
    if backup_mode == "host_pool":
        host = SGLangHostBackup(api=api, config=c, req_pool=sg_req_pool, allocator=sg_alloc, kv_pool=sg_kv)
        family.backup_mode, family.host_backup, family.host_pools = backup_mode, host, dict(host.views)
        views.update(host.views)
    family._free_views = views
    # The release's paged SWA resume: tail-only where its allocator can (0.5.12 on), else every position.
    family.resume_swa_tail_only = not c.has_swa or hasattr(sg_alloc, "alloc_extend_swa_tail")
    family.snapshot_free_lists()
    cannot_move = move_problem(sg_kv, dev)  # a pool that cannot move rows here: chain drafts only
    family.supports_tree_drafts = cannot_move is None
    if cannot_move:
        family.declined["tree_drafts"] = (f"{cannot_move}, so a tree verify's accepted-token move cannot run "
                                          "here; chain drafts only")
    family.pd_decode = pd_decode and gate_problem(api) is None
    if pd_problem(api) is None:
        family.transfer = SGLangPDTransfer()
        _decline_if_pd_refuses(family)
    else:
        family.supports_transfer = False
    return family


def _decline_if_pd_refuses(family: SGLangFamily) -> None:
    """Register the node for PD as SGLang's disaggregation setup does: where SGLang refuses the pool
    (``NotImplementedError``: 0.5.23's MiniMax pool with index values), no PD server of this model starts, so
    nothing is transferred, and nothing is backed up at retraction (only a PD decode server does that)."""
    try:
        registration(family)
        del family._pd_args  # registered again at the first transfer, as before (a test may patch it first)
    except NotImplementedError as exc:
        reason = f"SGLang {family.api.version}'s PD setup refuses this KV pool ({str(exc).splitlines()[0]})"
        family.supports_transfer = family.supports_retract = False
        family.transfer = None
        family.declined.update(transfer=reason, retract=reason + "; a colocated server recomputes a retracted request")
    except Exception:  # anything else is the first transfer's to report, as when registration was lazy
        pass


def _write_doors(sg_kv, c: ModelConfig):
    """The KV pool's own write door for the config's layers (``adapters.sglang.writes``), and the one a chain
    verify's window goes through (``committed=``; None: the plain door takes the whole window). A pool with
    scale buffers quantises what it is handed, so its rows (already bytes) are written directly."""
    if c.kv_scale_block or c.kv_quant == "fp4_mx_block16":
        return None, None
    if not storage_of(c).prefix_valid_door:  # MiniMax's sparse pool: its own door
        return functools.partial(write_msa_rows, sg_kv, config=c), None
    mha = [] if c.latent else [("full", i) for i in c.full_layer_ids] + [("swa", i) for i in c.swa_layer_ids]
    door = functools.partial(write_rows, sg_kv, mha_layers=mha, mla_layers=list(c.full_layer_ids) if c.latent else [],
                             model_dtype=MODEL_DTYPE if c.kv_quant else None)
    return door, door


def carries_mamba(api: SGLangAPI, kv_pool) -> tuple[bool, bool]:
    """(does the KV pool's CPU copy carry the recurrent state, did SGLang declare it).

    From #35957 on, SGLang declares it (``cpu_copy_carries_mamba``). Before, nothing does: the
    adapter infers it from whether the pool holds a reference to the MambaPool (only
    ``HybridLinearKVPool`` does). The harness audits the value against what the copy really
    held at every retraction, so a wrong inference would be reported, not trusted.
    """
    for klass in type(kv_pool).__mro__:
        if "cpu_copy_carries_mamba" in vars(klass):
            return bool(vars(klass)["cpu_copy_carries_mamba"]), True
    return getattr(kv_pool, "mamba_pool", None) is not None, False


def _mha_components(pool, layer_ids, space: str, *, door) -> list[Component]:
    """K and V of each layer of a sub-pool, as the model's KV pool ``door`` hands them to the kernels."""
    out = []
    for local, layer_id in enumerate(layer_ids):
        k = stored_bytes(read_door(door, "get_key_buffer", layer_id, pool.k_buffer[local]))
        v = stored_bytes(read_door(door, "get_value_buffer", layer_id, pool.v_buffer[local]))
        out.append(Component(name=f"{space}.k", layer=layer_id, space=space, tensor=k))
        out.append(Component(name=f"{space}.v", layer=layer_id, space=space, tensor=v))
    return out
