"""Building the prefix tree the installed release's scheduler would build, and sizing its mamba state slots."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

from poolfuzz.adapters.sglang.host_tier import hicache, l3
from poolfuzz.adapters.sglang.compat import has_private, private, published_extra_buffer, published_host_pool_backup
from poolfuzz.adapters.sglang.compat import server_flags as server_flag_names
from poolfuzz.adapters.sglang.server_args import NO_MODEL, another_server, publish_server_args


def mamba_sized(config, *, server: dict | None = None):
    """Mamba slots as SGLang sizes them for a radix cache on the published server (with ``server``, on a server
    with those flags): its ``_calculate_mamba_ratio`` (a state, a checkpoint and a copy-on-write a request, plus the
    extra buffer's track slots) times the request rows, where the config has fewer (a pool smaller than that makes
    the tree's own ``Can not alloc mamba cache`` assertion fire on a load the configurator never admits, and a server
    caps its running requests below the config's). A release without that rule: sized as given."""
    ratio = mamba_ratio(server) if config.has_mamba else None
    return config if ratio is None else with_mamba_ratio(config, ratio)


def with_mamba_ratio(config, ratio: int):
    """``config`` with ``ratio`` mamba slots for each of its request rows, where it has fewer."""
    return config.replace(mamba_slots=max(config.mamba_slots, ratio * config.request_rows))


def runner_mamba_ratio(server_args) -> int:
    """The model runner's own ``_calculate_mamba_ratio`` (0.5.10 to 0.5.15), unbound on a runner holding
    ``server_args``."""
    return private("runner_mamba_ratio")(SimpleNamespace(server_args=server_args))


def mamba_ratio(server: dict | None) -> int | None:
    """The mamba slots a running request takes on the published server (with ``server``: on one with those flags,
    published for the while), by the configurator's ``_calculate_mamba_ratio``, or before it the model runner's, on
    a server with those flags; None where the release has neither (0.5.9 sizes the state slots inline in
    ``init_memory_pool``: ``scheduling_global.inline_mamba_sized``) or, for the runner's, no flags are given."""
    from sglang.srt.server_args import ServerArgs

    named = None if server is None else server_flag_names(ServerArgs, server)
    if has_private("calculate_mamba_ratio"):
        from sglang.srt.runtime_context import get_server_args

        with another_server() if named is not None else nullcontext():
            if named is not None:
                publish_server_args(**named)
            # unbound: it reads the published flags (0.5.16 and 0.5.17 off the configurator, stood in for here)
            return private("calculate_mamba_ratio")(SimpleNamespace(server_args=get_server_args()))
    if named is None or not has_private("runner_mamba_ratio"):
        return None
    return runner_mamba_ratio(ServerArgs(model_path=NO_MODEL, device="cpu", **named))


def build_tree(family, *, hierarchical: bool = False, storage_dir: str | None = None, server: dict | None = None,
               worker=None):
    """The tree the release's scheduler builds for this model (its registry's default chain) on a server with the
    flags ``server`` (published first; default arguments where None; disabled where they say
    ``disable_radix_cache``); with ``hierarchical``, as ``--enable-hierarchical-cache`` builds it (``hicache.py``),
    and with a ``storage_dir`` also ``--hicache-storage-backend file`` there (``l3.py``). ``worker``: the TP worker
    stand-in of a server that built one (``decode_server.py``); its host tier, where the published arguments give
    the tree one (a decode server's ``host_pool`` retraction backup), is built and checked as SGLang's
    ``kv_cache_builder.build_kv_cache`` builds it, on the server's own host arguments."""
    disabled = bool((server or {}).get("disable_radix_cache"))
    if worker is not None:
        hicache.install_cpu_host_tier()
    ctx = build_context(family, hierarchical=hierarchical, disabled=disabled, server=server, worker=worker)
    from sglang.srt.mem_cache import registry

    c = family.config
    if not hierarchical:
        tree = registry.default_radix_cache_factory(ctx)
        if worker is not None and published_host_pool_backup():  # the retraction backup's host tier
            hicache.register_kernel_buffers(tree)
            tree.validate_retraction_host_capacity()  # build_kv_cache's own check of it
        return tree
    storage = l3.storage_arguments(c, storage_dir, hicache.host_layout(c)) if storage_dir else nullcontext()
    with hicache.hicache_arguments(c), storage:
        tree = registry.default_radix_cache_factory(ctx)
    hicache.register_kernel_buffers(tree)
    return tree


CHUNKED_PREFILL_SIZE = 8192  # a server's chunked prefill size when its GPU's memory is not asked


def build_context(family, *, hierarchical: bool, disabled: bool, server: dict | None = None, worker=None):
    """The registry's build context for this model, as the scheduler of a server with the flags ``server`` (default
    arguments where None) fills it; ``worker``: the server's TP worker stand-in, where it has one."""
    server = server or {}
    publish_server_args(**server)  # its mamba_chunk_size, where given, is the model's
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.runtime_context import get_server_args

    c = family.config
    extra = {}
    if server and "enable_mamba_extra_buffer" in getattr(CacheInitParams, "__dataclass_fields__", {}):
        # the scheduler's reading of the published arguments: whether the mamba radix cache keeps extra buffers
        extra["enable_mamba_extra_buffer"] = published_extra_buffer()
    params = CacheInitParams(disable=disabled, req_to_token_pool=family.sg_req_pool, **extra,
                             token_to_kv_pool_allocator=family.sg_allocator, page_size=c.page_size,
                             sliding_window_size=c.sliding_window if c.has_swa else None)
    fields = getattr(registry.TreeCacheBuildContext, "__dataclass_fields__", {})
    # 0.5.21's registry picks the chunk cache only where chunked prefill is on, as it is by default (the
    # registry asks only whether a size is set)
    chunked = {"effective_chunked_prefill_size": CHUNKED_PREFILL_SIZE} if "effective_chunked_prefill_size" in fields else {}
    return registry.TreeCacheBuildContext(
        # the published server's arguments, as the scheduler hands its own (0.5.16 and 0.5.17 read its flags there)
        server_args=get_server_args(), params=params, is_hybrid_swa=c.has_swa,
        is_hybrid_ssm=c.has_mamba, enable_hierarchical_cache=hierarchical, disable_radix_cache=disabled,
        tp_worker=worker or (hicache.worker_standin() if hierarchical else None), model_config=None,
        tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=c.full_tokens, **chunked)
