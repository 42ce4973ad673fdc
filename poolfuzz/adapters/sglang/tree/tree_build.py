"""Building the prefix tree the installed release's scheduler would build (``trees.py`` drives it)."""

from __future__ import annotations

from contextlib import nullcontext

from poolfuzz.adapters.sglang.host_tier import hicache, l3
from poolfuzz.adapters.sglang.compat import (has_private, private, published_extra_buffer, published_host_pool_backup,
                                             seed_mamba_chunk_size)

_PUBLISHED: dict[str, tuple] = {}  # "flags": the server flags this process last published
# SGLang's own model path for a server without weights: ServerArgs then skips what needs a model's config (0.5.18
# fetched one from the hub for any other path, so its server arguments could not be published offline).
NO_MODEL = "dummy"


def publish_server_args(*, mamba_chunk_size: int = 64, fresh: bool = False, **flags) -> None:
    """Publish a server's arguments into SGLang's runtime context, as a launcher does before the scheduler and its
    tree read them: ``ServerArgs`` with ``flags`` (the rest at their defaults), projected into the config bags with
    what SGLang derives from them at publish (``exec.mamba.enable_mamba_extra_buffer`` from
    ``mamba_radix_cache_strategy``, ...). No model, so no resolution pipeline, which would fetch one. Published again
    only where the flags differ from the last ones this process published; with no flags, where nothing is published
    yet, or where a server with other flags was (so the families that read the defaults do not run on another
    server's flags). ``mamba_chunk_size``: the model's (its HF config's; FLA's chunk, 64, where it names none).
    ``fresh``: published again whatever was published last (a server that resolves flags on its pools lands them in
    the context, so the next server with the same flags must not start from them)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    key = tuple(sorted(flags.items())) + ((("mamba_chunk_size", mamba_chunk_size),) if mamba_chunk_size != 64 else ())
    if _PUBLISHED.get("flags") == key and not fresh:
        return
    context = runtime_context.get_context()
    if key or "flags" in _PUBLISHED or not context.is_config_namespace_published("memory"):
        context.set_server_args(ServerArgs(model_path=NO_MODEL, device="cpu", **flags))
        # The server's widths now come from the arguments; the rank a launcher would write is the
        # single rank of a CPU run (MLA's pools and their retraction read it).
        parallel = runtime_context.get_parallel()
        try:
            parallel.attn_dcp_rank
        except (RuntimeError, ValueError):
            parallel.override_permanently(attn_dcp_rank=0)
    # The mamba checkpoint grid is max(the model's mamba chunk, page size), read from the model's HF
    # config, which a run without a model has none of: SGLang honours a pre-seeded value (as its
    # own test fixtures seed it). A model config without mamba_chunk_size gets FLA's chunk, 64 (the
    # value SGLang falls back to; importing the FLA kernels for it probes Triton's GPU driver).
    seed_mamba_chunk_size(runtime_context.get_server_args(), max(mamba_chunk_size, flags.get("page_size", 1)))
    _PUBLISHED["flags"] = key


def forget_published() -> None:
    """Something else published a server (the configurator path publishes its own): the next publish here runs."""
    _PUBLISHED.clear()


def mamba_sized(config):
    """Mamba slots as SGLang's configurator sizes them for a radix cache on the published server: its
    ``_calculate_mamba_ratio`` (a state, a checkpoint and a copy-on-write a request, plus the extra buffer's track
    slots) times the request rows, where the config has fewer (a pool smaller than that makes the tree's own
    ``Can not alloc mamba cache`` assertion fire on a load the configurator never admits). A release without the
    configurator's rule: sized as given."""
    if not config.has_mamba or not has_private("calculate_mamba_ratio"):
        return config
    ratio = private("calculate_mamba_ratio")(None)  # KVCacheConfigurator's, unbound: reads the published flags
    return config.replace(mamba_slots=max(config.mamba_slots, ratio * config.request_rows))


def publish_defaults() -> None:
    """The tree reads the server's configuration from SGLang's runtime context: a server with default arguments."""
    publish_server_args()


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


PYTHON_TREE_CORE = "python"
CHUNKED_PREFILL_SIZE = 8192  # a server's chunked prefill size when its GPU's memory is not asked


def build_disabled_cache(family):
    """The cache the release's scheduler builds with ``--disable-radix-cache`` for this model (its
    registry's choice: 0.5.23's is a disabled ``UnifiedRadixCache``, a pure-SWA model's a
    ``PureSWARadixCache``). It holds nothing; the adapter reads its accounting, never drives it."""
    ctx = build_context(family, hierarchical=False, disabled=True)  # defaults published first
    from sglang.srt.mem_cache import registry

    return registry.default_radix_cache_factory(ctx)


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
                             sliding_window_size=c.sliding_window if c.has_swa else None,
                             **({} if disabled else _tree_core(family, CacheInitParams)))
    fields = getattr(registry.TreeCacheBuildContext, "__dataclass_fields__", {})
    # 0.5.21's registry picks the chunk cache only where chunked prefill is on, as it is by default (the
    # registry asks only whether a size is set)
    chunked = {"effective_chunked_prefill_size": CHUNKED_PREFILL_SIZE} if "effective_chunked_prefill_size" in fields else {}
    return registry.TreeCacheBuildContext(
        server_args=get_server_args() if hierarchical or worker is not None else None, params=params, is_hybrid_swa=c.has_swa,
        is_hybrid_ssm=c.has_mamba, enable_hierarchical_cache=hierarchical, disable_radix_cache=disabled,
        tp_worker=worker or (hicache.worker_standin() if hierarchical else None), model_config=None,
        tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=c.full_tokens, **chunked)


def _tree_core(family, params_cls) -> dict:
    """Both of 0.5.23's tree cores run in every run: the prefill node keeps the default (the bundled Rust
    core, whose tree walk coverage cannot see), the PD decode server takes SGLang's Python core through
    its own per-cache override (``CacheInitParams.tree_core_backend``). A core named by
    ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` serves both nodes."""
    import os

    if "tree_core_backend" not in getattr(params_cls, "__dataclass_fields__", {}):
        return {}  # a release with one tree core
    if os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND") or not family.pd_decode:
        return {}
    return {"tree_core_backend": PYTHON_TREE_CORE}
