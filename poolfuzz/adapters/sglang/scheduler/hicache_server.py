"""SGLang's own Scheduler with a host tier (``--family sglang:hicache``): a server started with
``--enable-hierarchical-cache``, its radix tree backed by host pools, driven by SGLang's event loop.

What runs besides the scheduler path's (``scheduling.py``): the tree the registry builds with HiCache
(``UnifiedRadixCache.init_hicache``: the host pool group SGLang's assembler picks for each device pool and a
``HybridCacheController``), written through to the host as nodes are inserted (``--hicache-write-policy
write_through``, the default); eviction under pressure demotes backed-up nodes to the host and frees their device
slots; a later prefix that ends on the host is loaded back by ``PrefillAdder`` itself (``init_load_back``, with its
load-back budget), ``get_new_batch_prefill`` starts the load (``ready_to_load_host_cache``), and
``get_next_batch_to_run`` polls the transfers once a step (``check_hicache_events``). The model-runner stand-in checks
before every forward that each request attends to its own K and V, so a load-back that lands the wrong rows, or a
device slot freed while a load still points at it, is named as on every other path.

Stood in for, besides the scheduler path's stand-ins: the host memory layout and I/O backend are
``hicache.host_tier``'s (one pair per config shape, each with a CPU copy: ``host.py``, ``kernel_io.py``), published as
the server's ``--hicache-mem-layout`` / ``--hicache-io-backend``; the TP worker's load-back layer counter is not
waited on layer by layer (``hicache.worker_standin``): on the CPU the copies are done when ``start_loading`` returns,
before the forward reads them.

On the global-ServerArgs releases (0.5.9 to 0.5.15, ``scheduling_global``) the tree is the one that release's
Scheduler builds for ``--enable-hierarchical-cache`` (``HiRadixCache`` / ``HiMambaRadixCache`` from
``init_cache_with_memory_pool``, or the registry's), wrapped in a ``StreamingSession`` as the rest of that path's
trees are; the host tier's CPU stand-ins are the same, and 0.5.12's inline CUDA host register is answered by a runtime
that pins nothing (``hicache.install_cpu_host_register``). They get no L3 tier (:func:`storage_problem`).

With an L3 tier (where ``l3.storage_problem`` allows one: every config but the kinds SGLang's HiCache refuses), the
server is also started with ``--hicache-storage-backend`` (SGLang's ``file`` backend, or the zero-copy stand-in, per
``l3.storage_backend``) and ``--hicache-storage-prefetch-policy wait_complete``, and its host tier is a staging tier a
little larger than the device (``l3.HOST_RATIO``), so written-through prefixes leave the host within an example. What
runs is SGLang's: the tree backs every written-through node up into storage, ``_add_request_to_queue`` prefetches what
storage holds past a request's host hit (``Scheduler._prefetch_kvcache``), and ``get_new_batch_prefill`` admits it
once ``check_prefetch_progress`` says the pages are host nodes, to be loaded back like any host hit. Stood in for: the
time a server's four storage threads run between two of its steps. After every step, queued request and abort the
adapter waits until every backup and prefetch handed to them has come back and been polled (``l3.settle``), so an
example replays step for step; a storage operation not back within ``l3.SETTLE_SECONDS`` is reported as a hang.
"""

from __future__ import annotations

import weakref

from poolfuzz.adapters.sglang.host_tier import l3
from poolfuzz.adapters.sglang.scheduler.scheduling import SglangSchedulerDriver, scheduler_modules, server_arguments
from poolfuzz.adapters.sglang.shims import cpu_server, one_rank_group
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError


def hicache_server_problem(config: ModelConfig) -> str | None:
    """Why the HiCache server does not drive ``config`` with the installed SGLang, or None (the adapter's host-tier
    stand-ins, ``hicache.host_tier_problem``; on a global-ServerArgs release, whose Scheduler builds its own HiCache
    tree, the stand-ins alone; what SGLang itself refuses shows when the tree is built)."""
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.host_tier import hicache
    from poolfuzz.adapters.sglang.api import load

    api = load()  # the CPU shims go in before any sglang import
    if not compat.plans_with_context(scheduler_modules().Scheduler):
        # a global-ServerArgs release builds its own HiCache tree (HiRadixCache, HiMambaRadixCache, or 0.5.14's
        # UnifiedRadixCache for hybrid models): only the adapter's host-tier stand-ins are asked here
        return hicache.host_standin_problem(config)
    return hicache.host_tier_problem(api, config)


def storage_problem(config: ModelConfig) -> str | None:
    """Why the HiCache server runs ``config`` without an L3 tier, or None (``l3.storage_problem``)."""
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.api import load

    api = load()
    if not compat.plans_with_context(scheduler_modules().Scheduler):
        # the storage controller keys its files by the rank it reads from the runtime context (l3._single_rank)
        return f"SGLang {api.version} keeps one global ServerArgs and no runtime context to read the rank from"
    return l3.storage_problem(api, config)


class SglangHiCacheDriver(SglangSchedulerDriver):
    """One example's server started with ``--enable-hierarchical-cache``: the scheduler path over a tree with a host
    tier."""

    label = "the sglang HiCache server"
    family_name = "sglang:hicache"
    drives_speculative = False  # its own spec rounds (decode-side drafts, load-backs under a draft) are not yet
    hierarchical = True

    def __init__(self, config: ModelConfig, *, backup_mode: str | None = None):
        reason = hicache_server_problem(config)
        if reason:
            raise ConfigError(f"the sglang HiCache server cannot build {config.name!r}: {reason}")
        if storage_problem(config) is None:
            l3.warm_page_hash()  # a first hash compiles SGLang's extension: not on a storage thread, under its deadline
            self.storage_dir = l3.new_directory()
        try:
            super().__init__(config, backup_mode=backup_mode)
        except BaseException:
            l3.close(getattr(self, "tree", None), self.storage_dir)  # a tree built before the failure stops too
            raise
        # the server's shutdown when the example ends (close); a backstop where nobody closes it (a test's server)
        self._shutdown = weakref.finalize(self, l3.close, self.tree, self.storage_dir)
        from poolfuzz.adapters.sglang import compat

        tree = compat.wrapped_tree(self.tree)  # a StreamingSession forwards the poll to the tree it wraps
        if type(tree).check_hicache_events is _base_check_hicache_events():
            # the Scheduler polls check_hicache_events every step; this tree's is the base class's, which raises
            self._shutdown()
            raise ConfigError(f"the sglang HiCache server cannot build {config.name!r}: SGLang's registry builds a "
                              f"{type(tree).__name__} for this model, which has no host tier: its "
                              "check_hicache_events raises NotImplementedError on the server's first step")

    @property
    def listed_flags(self) -> dict:
        """The scheduler path's, and the tier flags its tree is built with (``hicache.hicache_flags``, and with an L3
        tier ``l3.storage_flags``; the files' directory is each run's own)."""
        from poolfuzz.adapters.sglang.host_tier import hicache

        tiers = hicache.hicache_flags(self.config)
        if self.storage_dir is not None:
            tiers |= l3.storage_flags(self.config, "<storage-dir>", tiers["hicache_mem_layout"])
        return super().listed_flags | tiers

    def close(self) -> None:
        """The server shuts down: its storage threads stop, its host pools are released, its L3 files removed."""
        self._shutdown()

    def _step(self) -> None:
        super()._step()
        self._storage_settled()

    def _queue(self, req) -> None:
        super()._queue(req)  # with an L3 tier, _add_request_to_queue prefetches from storage
        self._storage_settled()

    def abort(self, rid: str) -> None:
        super().abort(rid)
        self._storage_settled()

    def _storage_settled(self) -> None:
        """With an L3 tier: the storage threads' work handed to them so far, done and polled (``l3.settle``)."""
        if self.storage_dir is not None:
            with cpu_server(self.environment):
                l3.settle(self.tree)

    def pools_built(self):
        """The process group a one-rank server runs in: the host tier all-reduces its sizes over the default group
        (0.5.18). No TP worker stand-in of its own (the tree's build uses ``hicache.worker_standin``)."""
        one_rank_group()
        return None

    def server_flags(self, config: ModelConfig, *, max_running_requests: int) -> dict:
        """The scheduler path's flags, ``--enable-hierarchical-cache`` and the host tier's layout and I/O backend."""
        from poolfuzz.adapters.sglang.host_tier import hicache

        (layout, io_backend), _ = hicache.resolved_tier(config)
        return server_arguments(config, max_running_requests=max_running_requests) | {
            "enable_hierarchical_cache": True, "hicache_mem_layout": layout, "hicache_io_backend": io_backend}

    @property
    def host_tokens(self) -> int:
        """Token slots the tree's host tier holds now (written through, or demoted by eviction)."""
        from poolfuzz.adapters.sglang import compat

        return sum(pool.size - pool.available_size() for pool in compat.host_pools(self.tree))


def _base_check_hicache_events():
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    return BasePrefixCache.check_hicache_events


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the HiCache server does not drive ``config``, or None."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as scheduler_reason

    return hicache_server_problem(config) or scheduler_reason(config, SglangHiCacheDriver)


def build_hicache_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> SglangHiCacheDriver:
    """The ``sglang:hicache`` factory's driver (``servers.build_driver``'s checks of the run's options)."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode, driver_cls=SglangHiCacheDriver)
