"""SGLang's unified memory pool (``--enable-unified-memory``), built as its servers run on it
(``scheduler/unified_server.py``).

SGLang's KV cache configurator builds, for a hybrid model with the flag, one byte buffer shared by its
sub-pools, each with a ``MultiEndedAllocator`` over virtual ids: for a hybrid Mamba model the full-attention
KV (growing down) and the per-request Mamba state (growing up), bound in ``UnifiedMambaTokenToKVPoolAllocator``
and ``UnifiedHybridReqToTokenPool`` (``init_unified_mamba_pools``, built here); for a hybrid SWA model the
full and sliding-window KV, and with Mamba layers too the tri-pool (``unified_swa.py``). The family runs on the
pools SGLang's configurator builds for the config's server with ``--enable-unified-memory``
(``pools/configurator.py``) where they hold the config's layers, their sizes aside (SGLang sizes the sub-pools
from one byte envelope); the config is declined otherwise, saying why (``poolfuzz configs --family
sglang:unified-server`` shows SGLang's pools). Its components are SGLang's physical views read through SGLang's
tables (``unified_family.UnifiedFamily``).
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.pools.calls import paged_alloc_extend
from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable, load
from poolfuzz.adapters.sglang.pools.family import server_pools, served_words
from poolfuzz.adapters.sglang.pools.storage import single_rank, storage_of, what_failed
from poolfuzz.adapters.sglang.pools.request_pool import check_built
from poolfuzz.adapters.sglang.unified_pool.unified_family import (
    UnifiedFamily, prewarm_compaction, served_bundle, state_view, token_translate, translated_kv,
)
from poolfuzz.adapters.sglang.unified_pool.unified_swa import build_swa, swa_factory, tri_factory
from poolfuzz.adapters.sglang.pools.views import AllocatorView, FreeListView, KVPoolView, ReqPoolView, as_ints
from poolfuzz.adapters.sglang.pools.writes import as_pool_dtype, RadixAttentionFields, latent_keys, latent_row
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import resolve_device


# What makes a server's pools these: SGLang's configurator builds them with its unified factories.
SERVER_FLAGS = {"enable_unified_memory": True}


def unified_problem(api: SGLangAPI, config: ModelConfig, *, role_flags: dict | None = None) -> str | None:
    """Why the unified pool of this SGLang is not driven for ``config`` here, or None; ``role_flags``: the role the
    server plays beside the unified server's flags (a decode server's), whose refusal is SGLang's."""
    if unified_mamba_factory() is None:
        return (f"SGLang {api.version} has no unified memory pool (--enable-unified-memory's "
                "init_unified_mamba_pools in mem_cache/unified_memory_pool.py, 0.5.15 on); use --family sglang")
    sub_pool = first_importable("sglang.srt.mem_cache.allocator.unified_sub_pool:MultiEndedAllocator", required=False)
    if sub_pool is None:
        return (f"SGLang {api.version}'s unified memory pool predates the layout poolfuzz drives (0.5.23's "
                "MultiEndedAllocator in mem_cache/allocator/unified_sub_pool.py); use --family sglang")
    if not hasattr(sub_pool, "translate_write_loc"):
        # the write door hands the pool ``KVWriteLoc(translate_write_loc(loc), physical=True)``, as the
        # attention backends of 0.5.22 on do; an earlier unified pool is written another way, not modelled
        return (f"SGLang {api.version}'s unified allocator has no translate_write_loc (the physical write "
                "location a forward hands the pool from 0.5.22 on), which poolfuzz's write door uses; use "
                "--family sglang")
    if config.has_swa and (tri_factory() if config.has_mamba else swa_factory()) is None:
        return f"SGLang {api.version} has no unified pool factory for this model's layers; use --family sglang"
    if not config.has_mamba and not config.has_swa:
        return ("SGLang builds the unified memory pool only for hybrid Mamba and hybrid SWA models "
                "(kv_cache_configurator: '--enable-unified-memory only supports hybrid Mamba and hybrid "
                "sliding-window-attention models'); use --family sglang for this config")
    if config.spec_draft_tokens:
        return ("speculative decoding's per-draft mamba caches on the unified pool are not driven by "
                "poolfuzz yet; use hybrid-linear, hybrid-extra-buffer, swa or swa-ssm")
    if why := storage_of(config).unified:
        return why.format(version=api.version)
    from poolfuzz.adapters.sglang.pools import configurator

    # a unified server SGLang's own validation refuses starts nowhere: declined with SGLang's words
    refused = configurator.refusal(config, role_flags=SERVER_FLAGS | (role_flags or {}))
    if refused:
        return refused
    return _factory_problem(api, config, role_flags)


_FACTORY_PROBE: dict[tuple, str | None] = {}


def _factory_problem(api: SGLangAPI, config: ModelConfig, role_flags: dict | None) -> str | None:
    """Build the config's server's unified stack once, and allocate on it as a first request does: a factory that
    refuses the model's layers declines the config here, with its reason, instead of at every example of a run that
    counted it in (the SWA factory of 0.5.22 and 0.5.23 asserts that an SWA hybrid without full-attention layers,
    swa-only, is degenerate); so does an allocator that launches a kernel this machine cannot run (0.5.22 zeroes the
    pages it hands an MLA sub-pool with a Triton kernel, ``zero_physical_pages``; the unified sub-pool allocator
    launches SGLang's Triton ``alloc_extend_kernel`` for every paged allocation, having no CPU path, unlike
    ``PagedTokenToKVPoolAllocator``)."""
    key = (config, tuple(sorted((role_flags or {}).items())))
    if key not in _FACTORY_PROBE:
        problem = None
        try:
            decode = (role_flags or {}).get("disaggregation_mode") == "decode"
            family = _served_family(api, config, role_flags=role_flags,
                                    listing="sglang:unified-decode" if decode else "sglang:unified-server")
        except ConfigError as exc:
            problem = str(exc)
        else:
            try:
                if config.page_size > 1:
                    out = paged_alloc_extend(family.sg_allocator, prefix_len=0, seq_len=3, last_loc=-1)
                    if out is None or out.numel() != 3:
                        problem = f"the unified pool's paged alloc_extend gave {out!r} on an empty pool"
                else:
                    family.sg_allocator.alloc(1)
            except Exception as exc:  # a kernel launch without Triton raises one of many types
                problem = (f"SGLang {api.version}'s unified allocator launches a kernel on its first allocation for "
                           f"this model that cannot run here ({type(exc).__name__}: {what_failed(exc)}); "
                           + ("use a page-size-1 config, or " if config.page_size > 1 else "")
                           + "install Triton (ci/sglang-install.sh VENV VERSION --triton), or use --family sglang")
        _FACTORY_PROBE[key] = problem
    return _FACTORY_PROBE[key]


def unified_mamba_factory():
    """SGLang's ``init_unified_mamba_pools``, or None where the release has no unified pool."""
    return first_importable("sglang.srt.mem_cache.unified_memory_pool:init_unified_mamba_pools", required=False)


def build_unified(config: ModelConfig, *, node: str | None = None, role_flags: dict | None = None) -> UnifiedFamily:
    """The unified pools SGLang's configurator builds for the config's server with ``--enable-unified-memory``, on the
    CPU where the scheduler runs, where they are the config's pools, their sizes aside (SGLang sizes the sub-pools
    from one byte envelope); ``node="decode"``: a PD decode server's, ``role_flags`` its flags beside the unified
    server's."""
    api = load()
    problem = unified_problem(api, config, role_flags=role_flags)
    if problem:
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: {problem}")
    return _served_family(api, config, role_flags=role_flags,
                          listing="sglang:unified-decode" if node == "decode" else "sglang:unified-server")


def _served_family(api: SGLangAPI, config: ModelConfig, *, role_flags: dict | None, listing: str) -> UnifiedFamily:
    """The family over the unified pools SGLang's configurator builds for the config's server (``server_pools``)."""
    try:
        served = server_pools(config, "cpu", role_flags=SERVER_FLAGS | (role_flags or {}), sized=False,
                              listing=listing)
        single_rank(api)
        return (build_swa if config.has_swa else _mamba_family)(api, config, resolve_device("cpu"), served)
    except (AssertionError, ValueError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"config {config.name!r} on sglang {api.version}: SGLang's unified pool factory "
                          f"refuses it ({type(exc).__name__}: {first})") from None


def _mamba_family(api: SGLangAPI, c: ModelConfig, dev, served) -> UnifiedFamily:
    """The family over a hybrid Mamba model's unified pools (``init_unified_mamba_pools``' stack, as served)."""
    bundle = served_bundle(served)
    req_pool, kv_pool, alloc = bundle.req_to_token_pool, bundle.token_to_kv_pool, bundle.token_to_kv_pool_allocator
    problem = check_built(req_pool, c)
    if problem:
        raise ConfigError(f"config {c.name!r} on sglang {api.version}: {problem}")
    prewarm_compaction(alloc)
    full, mamba = alloc.full_attn_allocator, alloc.mamba_allocator
    comps = translated_kv(kv_pool.full_kv_pool, c.full_layer_ids, "full", token_translate(full),
                          latent_rank=c.kv_lora_rank if c.latent else None)
    mamba_view = state_view(req_pool, c.mamba_layer_ids)
    write_loc = first_importable("sglang.srt.mem_cache.memory_pool:KVWriteLoc")

    def door(*, slots, rows):
        """A forward's KV writes: the backend hands SGLang's door the location its plan translated, marked
        physical (``KVWriteLoc(loc, physical=True)``, as the pool's door demands)."""
        loc = slots.to(torch.int64)
        physical = write_loc(alloc.translate_write_loc(loc), physical=True)
        done = set()
        for layer_id in c.full_layer_ids:
            k, v = ("full.k", layer_id), ("full.v", layer_id)
            if k in rows and v in rows:
                kv_pool.set_kv_buffer(RadixAttentionFields(layer_id), physical, as_pool_dtype(rows[k], kv_pool),
                                      as_pool_dtype(rows[v], kv_pool))
                done |= {k, v}
            elif ("mla.latent", layer_id) in rows:  # the CPU backends' MLA door: one latent row, no V
                kv_pool.set_kv_buffer(RadixAttentionFields(layer_id), physical, latent_row(rows, layer_id, kv_pool),
                                      None)
                done.update(latent_keys(rows, layer_id))
        return done

    views = {"rows": FreeListView(space="rows", owner=req_pool, read=lambda: as_ints(req_pool.free_slots),
                                  available=req_pool.available_size)}
    for space, sub in (("full", full), ("mamba", mamba)):
        # the sub-allocator's virtual ids: the slots the harness tracks (pages for the full side)
        views[space] = FreeListView(space=space, owner=sub, read=lambda s=sub: as_ints(s.free_virtual_ids),
                                    available=lambda s=sub: s.free_virtual_ids.numel() * s.pool_page_size,
                                    page_size=sub.pool_page_size, sources=lambda s=sub: [s.free_virtual_ids])
    family = UnifiedFamily(
        api=api, config=c, device=dev, uses_ssm_state=uses_ssm_state(c), sg_req_pool=req_pool, sg_kv_pool=kv_pool,
        sg_allocator=alloc, req_pool=ReqPoolView(req_pool, mamba=mamba_view, rows=views["rows"],
                                                 mamba_free=views["mamba"]),
        kv_pool=KVPoolView(kv_pool, comps, door=door), allocator=AllocatorView(alloc, swa=False), served=served,
        pools_source=served_words(served))
    family.unified_buffer = bundle.unified_memory_pool
    family._free_views = views
    return family
