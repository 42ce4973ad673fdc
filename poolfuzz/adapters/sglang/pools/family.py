"""The pools of one SGLang server for one model, built by the installed SGLang, seen through thin views its drivers
read (``scheduler/``, ``unified_pool/``).

Every tensor a check reads is SGLang's own buffer (``k_buffer[l]``, ``v_buffer[l]``, the MambaPool's conv and temporal
state); every free list is read from SGLang's allocator objects. The views only translate: ids to Python ints, and
free lists to the ``available_size`` / ``free_pages`` queries the drivers' leak and idle checks ask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, construct, load, switched_on
from poolfuzz.adapters.sglang.pools.calls import native_kv_move, paged_alloc_extend
from poolfuzz.adapters.sglang.pools.descriptions import describe_pools, same_pools
from poolfuzz.adapters.sglang.pools.hybrid_mla import build_hybrid_mla_pool, hybrid_mla_problem
from poolfuzz.adapters.sglang.pools.minimax import write_msa_rows
from poolfuzz.adapters.sglang.pools.reads import read_door, stored_bytes
from poolfuzz.adapters.sglang.pools.request_pool import (build_plain_request_pool, build_request_pool, check_built,
                                                         rows_over_slots, server_row_width)
from poolfuzz.adapters.sglang.pools.storage import (build_storage_pool, quant_method_kwargs, storage_of,
                                                     storage_problem)
from poolfuzz.adapters.sglang.pools.speculative import SGLangScratch, speculative_problem
from poolfuzz.adapters.sglang.pools.writes import write_rows
from poolfuzz.adapters.sglang.pools.extra_buffer import extra_buffer_problem
from poolfuzz.adapters.sglang.pools.views import (AllocatorView, FreeListView, KVPoolView, MambaPoolView, ReqPoolView,
                                                  as_ints, token_free_pages, token_free_sources)
from poolfuzz.pools.capabilities import PoolsOrigin
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import resolve_device
from poolfuzz.pools.quantised import MODEL_DTYPE

# SGLang's memory-pool debug switch, on while pools are constructed (each reads it then): its allocators then check
# their own frees, as a server started with it does
DEBUG_SWITCH = "SGLANG_DEBUG_MEMORY_POOL"

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# =============================================================================================
# The family
# =============================================================================================
@dataclass(kw_only=True)
class SGLangFamily:
    """The pools of one server for one model, built by the installed SGLang: SGLang's own objects (``sg_*``), the
    views of them the model-runner stand-in writes through and the checks read, and who built them:
    ``pools_origin`` is the engine's where SGLang's own configurator built the pools for the config's server
    (``served``), the adapter's wiring otherwise; ``pools_source`` says which server, or why."""

    api: SGLangAPI
    config: ModelConfig
    device: torch.device
    uses_ssm_state: bool = False
    sg_req_pool: object = None
    sg_kv_pool: object = None
    sg_allocator: object = None
    req_pool: ReqPoolView = None
    kv_pool: KVPoolView = None
    allocator: AllocatorView = None
    # Backups whose tensors aliased a live pool buffer and were copied (CPU only; see scheduler/backups.py).
    cpu_aliases: list = field(default_factory=list)
    # who built the pools: SGLang's KV cache configurator for the config's server, or the adapter's wiring and why
    pools_source: str = "the adapter's wiring"
    # what SGLang's configurator built and sized, where the family runs on it (``configurator.ConfiguredPools``)
    served: object = None
    _free_views: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"SGLangFamily({self.config.name}, sglang {self.api.version}, {self.device})"

    def components(self) -> list[Component]:
        out = self.kv_pool.components()
        if self.req_pool.mamba_pool is not None:
            out += self.req_pool.mamba_pool.components()
            if self.req_pool.mamba_pool.spec_scratch is not None:
                out += self.req_pool.mamba_pool.spec_scratch.components()
        return out

    @property
    def pools_origin(self) -> PoolsOrigin:
        """SGLang's own code built the pools where its configurator served the config's server, else the adapter."""
        return PoolsOrigin(built_by="adapter" if self.served is None else "engine", detail=self.pools_source)

    def free_lists(self) -> dict[str, FreeListView]:
        return dict(self._free_views)


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the installed SGLang builds no pools for ``config`` here, or None. Probes, never versions: what a server
    refuses of the config's flags is asked of SGLang itself once a driver publishes its server."""
    api = load()
    if config.has_swa and not config.has_full and api.PureSWATokenToKVPoolAllocator is None:
        return (f"SGLang {api.version} has no PureSWATokenToKVPoolAllocator: it builds no pools for an all-SWA "
                "model (every layer sliding-window; full_layers = 0)")
    if config.page_size > 1:
        problem = _paged_allocation_problem(api)
        if problem:
            return problem
    if config.latent and config.has_mamba:
        return extra_buffer_problem(api, config) or speculative_problem(api, config) or hybrid_mla_problem(api, config)
    return extra_buffer_problem(api, config) or speculative_problem(api, config) or storage_problem(api, config)


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


def build_sglang_family(config: ModelConfig, *, device="cpu", decode_rows: int | None = None,
                        role_flags: dict | None = None, listing: str = "sglang:scheduler") -> SGLangFamily:
    """The pools of the server a scheduler-path driver starts for ``config`` (its flags published already).
    ``listing``: the family whose ``poolfuzz configs --family`` listing shows SGLang's pools beside the wiring's, as a
    message on the wiring names it. ``role_flags``: the server flags of the role the server plays (its decode
    server's), with which SGLang's configurator builds its pools. ``decode_rows``: the request pool is a PD decode
    server's, with that many rows more for requests in pre-allocation and transfer."""
    api = load()
    reason = unsupported_reason(config)
    if reason:
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: {reason}")
    dev = resolve_device(device)
    sdev = str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    try:
        with switched_on(DEBUG_SWITCH), native_kv_move():
            pd_decode = decode_rows is not None
            build = functools.partial(_build, api, config, dev, sdev, pd_decode=pd_decode, decode_rows=decode_rows)
            family = served_or_wired(build, config, sdev, pd_decode=pd_decode, role_flags=role_flags,
                                     listing=listing)
            rows = rows_over_slots(family.sg_req_pool)
            if rows:  # as the release's servers size it: a state slot for every row
                return build_sglang_family(config.replace(mamba_slots=rows), device=device, decode_rows=decode_rows,
                                           role_flags=role_flags, listing=listing)
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
                    same=None, listing: str):
    """The family over the pools SGLang's configurator builds for the config's server where they are the config's
    (``_server_pools``; ``same``: how the two builds' descriptions must agree, ``descriptions.same_pools`` by
    default), else over the adapter's wiring (``build``: the family's builder with all but ``served`` given).
    ``listing``: the family whose ``poolfuzz configs --family`` listing shows the two builds."""
    from poolfuzz.adapters.sglang.pools import configurator

    key = (config, tuple(sorted((role_flags or {}).items())), pd_decode, sdev)
    if key not in _SERVES:
        family = build()
        served = _server_pools(config, family, sdev, role_flags=role_flags,
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


def _server_pools(config: ModelConfig, family: SGLangFamily, sdev: str, *, role_flags: dict | None = None,
                  same, listing: str):
    """The pools SGLang's own KV cache configurator builds for the config's server (``pools/configurator.py``), where
    it builds them here and they are the pools the config describes: the classes, sizes, mamba shapes and layers of
    the family's own wiring, the request rows' width aside. None otherwise, and ``family.pools_source`` says why the
    family keeps its wiring (``poolfuzz configs --family LISTING`` shows how the two differ)."""
    from poolfuzz.adapters.sglang.pools import configurator

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


def _build(api: SGLangAPI, config: ModelConfig, dev, sdev: str, *, pd_decode: bool = False,
           decode_rows: int | None = None, served=None) -> SGLangFamily:
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
    if c.has_mamba:
        sg_req_pool = _take(served, "req_to_token_pool",
                            lambda: build_request_pool(api, c, sdev, decode_rows=decode_rows,
                                                       width=server_row_width(c)))
        problem = check_built(sg_req_pool, c)
        if problem:
            raise ConfigError(f"config {c.name!r} on sglang {api.version}: {problem}")
        mamba_view = MambaPoolView(sg_req_pool.mamba_pool, c.mamba_layer_ids, req_pool=sg_req_pool)
        if c.spec_draft_tokens:
            mamba_view.spec_scratch = SGLangScratch(sg_req_pool, layer_ids=c.mamba_layer_ids,
                                                    draft_tokens=c.spec_draft_tokens)
    else:
        sg_req_pool = _take(served, "req_to_token_pool",
                            lambda: build_plain_request_pool(api, c, sdev, decode_rows=decode_rows,
                                                             width=server_row_width(c)))

    comps: list[Component] = []
    if not c.has_mamba and (storage_of(c).own_pool or c.kv_scale_block or c.kv_quant == "fp4_mx_block16"):
        sg_kv, comps = build_storage_pool(api, c, common,
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
    door = _write_door(sg_kv, c)
    view_cls = type(type(sg_kv).__name__, (KVPoolView,),
                    {"cpu_copy_carries_mamba": carries, "declared": declared, "__module__": __name__})
    return SGLangFamily(
        api=api, config=c, device=dev, uses_ssm_state=uses_ssm_state(c), sg_req_pool=sg_req_pool,
        sg_kv_pool=sg_kv, sg_allocator=sg_alloc,
        req_pool=ReqPoolView(sg_req_pool, mamba=mamba_view, rows=views["rows"], mamba_free=mamba_free),
        kv_pool=view_cls(sg_kv, comps, door=door),
        allocator=AllocatorView(sg_alloc, swa=c.has_swa), _free_views=views)


def _write_door(sg_kv, c: ModelConfig):
    """The KV pool's own write door for the config's layers (``pools/writes.py``), or None: a pool with scale buffers
    quantises what it is handed, so its rows (already bytes) are written directly."""
    if c.kv_scale_block or c.kv_quant == "fp4_mx_block16":
        return None
    if not storage_of(c).set_kv_buffer_door:  # MiniMax's sparse pool: its own door
        return functools.partial(write_msa_rows, sg_kv, config=c)
    mha = [] if c.latent else [("full", i) for i in c.full_layer_ids] + [("swa", i) for i in c.swa_layer_ids]
    return functools.partial(write_rows, sg_kv, mha_layers=mha, mla_layers=list(c.full_layer_ids) if c.latent else [],
                             model_dtype=MODEL_DTYPE if c.kv_quant else None)


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
