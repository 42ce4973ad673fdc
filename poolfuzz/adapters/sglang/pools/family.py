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
from poolfuzz.adapters.sglang.pools.hybrid_mla import hybrid_mla_components
from poolfuzz.adapters.sglang.pools.minimax import write_msa_rows
from poolfuzz.adapters.sglang.pools.reads import read_door, stored_bytes
from poolfuzz.adapters.sglang.pools.request_pool import check_built, rows_over_slots
from poolfuzz.adapters.sglang.pools.storage import storage_components, storage_of, storage_problem
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


# =============================================================================================
# The family
# =============================================================================================
@dataclass(kw_only=True)
class SGLangFamily:
    """The pools of one server for one model, as SGLang's configurator built them for it (``served``): SGLang's own
    objects (``sg_*``), the views of them the model-runner stand-in writes through and the checks read, and which
    server they are (``pools_source``)."""

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
    # what SGLang's configurator built and sized (``configurator.ConfiguredPools``), and for which server, in words
    served: object
    pools_source: str
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
        """SGLang's own code built the pools: its configurator, for the config's server."""
        return PoolsOrigin(built_by="engine", detail=self.pools_source)

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


def build_sglang_family(config: ModelConfig, *, device="cpu", role_flags: dict | None = None,
                        listing: str = "sglang:scheduler") -> SGLangFamily:
    """The pools of the server a scheduler-path driver starts for ``config`` (its flags published already), as
    SGLang's own configurator (before 0.5.16, its model runner) builds them for that server. ``role_flags``: the
    server flags of the role the server plays (a PD decode server's). ``listing``: the family whose ``poolfuzz configs
    --family`` listing shows the pools, which a decline names. Where SGLang builds no pools for the server here, or
    pools that are not the config's (``pools_problem``), the config is declined with the reason: no pools of the
    adapter's stand in for the server's."""
    api = load()
    reason = unsupported_reason(config)
    if reason:
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: {reason}")
    dev = resolve_device(device)
    sdev = str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    try:
        with switched_on(DEBUG_SWITCH), native_kv_move():
            served = server_pools(config, sdev, role_flags=role_flags, listing=listing)
            family = _build(api, config, dev, served)
            rows = rows_over_slots(family.sg_req_pool)
            if rows:  # as the release's servers size it: a state slot for every row
                return build_sglang_family(config.replace(mamba_slots=rows), device=device, role_flags=role_flags,
                                           listing=listing)
            return family
    except ConfigError:
        raise  # declined already, with its reason (a server SGLang refuses among them)
    except (AssertionError, ValueError) as exc:
        # SGLang's constructors decide what this release can build: a config they refuse is
        # declined (a drawn one is skipped), never reported as a bug found in the pools.
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: SGLang's constructors refuse it "
                          f"({type(exc).__name__}: {first})") from None


def server_pools(config: ModelConfig, sdev: str, *, role_flags: dict | None, listing: str, sized: bool = True):
    """The pools SGLang's configurator builds for the config's server (``configurator.configure``), where they are the
    config's pools (``pools_problem``; ``sized``: their token slots are the config's too); a ConfigError with the
    reason otherwise (``poolfuzz configs --family LISTING`` shows what SGLang built)."""
    from poolfuzz.adapters.sglang.pools import configurator

    try:
        served = configurator.configure(config, device=sdev, role_flags=role_flags)
    except configurator.ServerRefused:
        raise  # no such server starts: the config is declined, with SGLang's words
    except ConfigError as exc:
        raise ConfigError(f"{exc}; no pools of the adapter's stand in for the server's") from None
    problem = pools_problem(config, served, sized=sized)
    if problem:
        raise ConfigError(f"config {config.name!r}: {configurator.builder()} builds its server's pools "
                          f"({served.server.command_line()}) otherwise than the config: {problem}; the config stands "
                          f"for no server of this release (poolfuzz configs --family {listing} shows the server's)")
    return served


def pools_problem(config: ModelConfig, served, *, sized: bool = True) -> str | None:
    """How the pools SGLang built for the config's server differ from the config's, in the facts its checks and
    its scheduler's caps rest on: the layers each space holds, the recurrent state's layers and shapes, and
    (``sized``) each space's token slots; None where they agree. What is SGLang's own answer to the flags is never
    compared: which classes it chose (the components are read from whatever it built, and a kind of component its
    pools lack declines there, ``_build``), how many state slots and request rows it gave the server (a decode
    server's pre-allocation adds to both; the checks read SGLang's free lists)."""
    c = config
    kv = served.token_to_kv_pool
    facts = []  # (what, the config's, the server's)
    mapping = getattr(kv, "layers_mapping", None)  # a sliding-window pool's: layer -> (sub-pool layer, is SWA)
    if isinstance(mapping, dict) and mapping:
        facts.append(("sliding-window layers", list(c.swa_layer_ids), sorted(i for i, (_, w) in mapping.items() if w)))
        facts.append(("full-attention layers", list(c.full_layer_ids),
                      sorted(i for i, (_, w) in mapping.items() if not w)))
    elif c.has_swa:
        facts.append(("sliding-window layers", list(c.swa_layer_ids), []))
    full_ids = getattr(kv, "full_attention_layer_id_mapping", None)  # a hybrid linear pool's
    if isinstance(full_ids, dict):
        facts.append(("full-attention layers", list(c.full_layer_ids), sorted(full_ids)))
    mamba = getattr(served.req_to_token_pool, "mamba_pool", None)
    facts.append(("recurrent state", c.has_mamba, mamba is not None))
    if c.has_mamba and mamba is not None:
        cache = mamba.mamba_cache
        facts += [("recurrent layers", len(c.mamba_layer_ids), cache.temporal.shape[0]),
                  ("conv state shapes", [tuple(s) for s in c.conv_shapes], [tuple(t.shape[2:]) for t in cache.conv]),
                  ("temporal state shape", tuple(c.temporal_shape), tuple(cache.temporal.shape[2:]))]
    if sized:
        swa = getattr(kv, "swa_kv_pool", None)
        if c.has_full:
            facts.append(("full-attention token slots", c.full_tokens, getattr(kv, "full_kv_pool", kv).size))
        if c.has_swa:
            facts.append(("sliding-window token slots", c.swa_tokens, None if swa is None else swa.size))
    differ = [f"{what} {mine} (SGLang's: {theirs})" for what, mine, theirs in facts if mine != theirs]
    return "; ".join(differ) or None


def _build(api: SGLangAPI, config: ModelConfig, dev, served) -> SGLangFamily:
    """The family over the pools SGLang's configurator built for the config's server (``served``): SGLang's request
    pool, KV pool and allocator, their components read through the KV pool's own doors, their free lists through
    the allocator and its sub-allocators."""
    c = config
    sg_req_pool, sg_kv, sg_alloc = served.req_to_token_pool, served.token_to_kv_pool, served.allocator
    problem = check_built(sg_req_pool, c)
    if problem:
        raise ConfigError(f"config {c.name!r} on sglang {api.version}: {problem}")
    mamba_view = None
    if c.has_mamba:
        mamba_view = MambaPoolView(sg_req_pool.mamba_pool, c.mamba_layer_ids, req_pool=sg_req_pool)
        if c.spec_draft_tokens:
            mamba_view.spec_scratch = SGLangScratch(sg_req_pool, layer_ids=c.mamba_layer_ids,
                                                    draft_tokens=c.spec_draft_tokens)
    if c.latent and c.has_mamba:  # Kimi-Linear: MLA (or DSA) layers between recurrent ones
        comps = hybrid_mla_components(api, sg_kv, c)
    elif not c.has_mamba and (storage_of(c).own_pool or c.kv_scale_block or c.kv_quant == "fp4_mx_block16"):
        comps = storage_components(api, c, sg_kv)
    else:  # K and V rows: a plain MHA pool, the sub-pools of a sliding-window or hybrid linear one
        comps = []
        if c.has_full:
            comps += _mha_components(getattr(sg_kv, "full_kv_pool", sg_kv), c.full_layer_ids, "full", door=sg_kv)
        if c.has_swa:
            comps += _mha_components(sg_kv.swa_kv_pool, c.swa_layer_ids, "swa", door=sg_kv)
    subs = {}
    if c.has_full:
        subs["full"] = sg_alloc.full_attn_allocator if c.has_swa else sg_alloc
    if c.has_swa:
        subs["swa"] = sg_alloc.swa_attn_allocator

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
        kv_pool=view_cls(sg_kv, comps, door=door), allocator=AllocatorView(sg_alloc, swa=c.has_swa),
        served=served, pools_source=served_words(served), _free_views=views)


def served_words(served) -> str:
    """Who built ``served`` and for which server, in a family's ``pools_source`` words."""
    from poolfuzz.adapters.sglang.pools import configurator

    return f"{configurator.builder()} ({served.server.command_line()})"


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
