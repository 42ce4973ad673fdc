"""HiCache through SGLang's own tree: device->host write-through and host->device load-back on the CPU.

A prefill server started with ``--enable-hierarchical-cache`` builds its ``UnifiedRadixCache`` with a
host tier (``init_hicache``: a ``HostPoolGroup`` of the host pool SGLang's assembler picks for each
device pool, and a ``HybridCacheController``). Cached nodes are written through to the host as they
are inserted; eviction under pressure demotes a backed-up node to the host and frees its device slots;
a later match that ends on the host is loaded back by the prefill adder (``init_load_back``, under a
host lock), and the scheduler polls the transfers once a step (``check_hicache_events``). The HiCache
server (``scheduler/hicache_server.py``) runs that path with what this module gives it: the host memory
layout and I/O backend of :func:`host_tier` (the ``kernel`` backend's copies on a CPU are ``kernel_io``'s).

One call-time stand-in: a host pool pins its buffer with ``cudaHostRegister`` when ``pin_memory`` is
set, which is the assembler's default; where torch has no CUDA (a CPU-only machine) there is nothing
to pin, so :func:`install_cpu_host_register` gives ``pool_host.common`` a register that records no
range (what ``destroy`` then unregisters: nothing). SGLang's own register is never replaced where CUDA
exists. The copies themselves are ``host.install_cpu_transfer_ops``'s.
"""

from __future__ import annotations

import re
import types
from contextlib import contextmanager

import torch

from poolfuzz.adapters.sglang.compat import has_private, host_tier_pools, private, private_name
from poolfuzz.adapters.sglang.host_tier.host import HOST_LAYOUT, IO_BACKEND, install_cpu_transfer_ops
from poolfuzz.adapters.sglang.host_tier.kernel_io import install_cpu_kernel_ops, register_buffers
from poolfuzz.adapters.sglang.pools.storage import storage_of
from poolfuzz.pools.config import ModelConfig

HOST_RATIO = 2.0  # SGLang's default --hicache-ratio: host pages = 2 x device pages
WRITE_POLICY = "write_through"  # SGLang's default --hicache-write-policy


def host_tier_problem(api, config: ModelConfig) -> str | None:
    """Why the adapter cannot give ``config``'s tree SGLang's host tier on the CPU, or None: what SGLang itself
    refuses is its own answer, when the tree is built (the scheduler path asks only this)."""
    if why := host_standin_problem(config):
        return why
    try:
        from sglang.srt.mem_cache import unified_radix_cache as urc
    except ImportError:
        return f"SGLang {api.version} has no unified radix tree"
    if not all(hasattr(urc.UnifiedRadixCache, m) for m in ("init_hicache", "init_load_back", "check_hicache_events")):
        return f"SGLang {api.version}'s tree has no HiCache entry points (init_hicache / init_load_back)"
    return None


def host_standin_problem(config: ModelConfig) -> str | None:
    """Why the adapter has no CPU stand-in for ``config``'s host pools (its storage's ``host_tier``), or None."""
    return storage_of(config).host_tier


def install_cpu_host_register() -> bool:
    """A no-op ``cudaHostRegister`` for host pools on a machine without CUDA (see the module docstring): the
    release's own register function, or where its host pools call the CUDA runtime inline (0.5.12's
    ``alloc_with_host_register``), a runtime for them whose host (un)register succeeds and pins nothing."""
    if torch.cuda.is_available():
        return False  # CUDA registers for real
    if has_private("inline_host_register") and not has_private("cuda_host_register"):
        torch.cuda.cudart = lambda: _HOST_REGISTRATION_ONLY
        return True
    if not has_private("cuda_host_register"):
        return False  # a release without the register has nothing to replace
    from sglang.srt.mem_cache.pool_host import common

    # where the release records what it registered (0.5.23), the record says nothing was, so destroy() unregisters
    # nothing; 0.5.18 records nothing
    attr = private("cuda_host_ranges_attr") if has_private("cuda_host_ranges_attr") else None

    def register_nothing(buffer, registration_granularity_bytes=None):
        if attr is not None:
            setattr(buffer, attr, [])

    setattr(common, private_name("cuda_host_register"), register_nothing)
    return True


# ``torch.cuda.cudart()`` on a machine without CUDA, as far as a host pool asks it: registering a buffer for DMA
# succeeds (cudaSuccess, 0) and pins nothing (there is no device to copy to); anything else it is asked is absent.
_HOST_REGISTRATION_ONLY = types.SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: 0,
                                                cudaHostUnregister=lambda ptr: 0)


# The ``kernel`` backend's layouts (``--hicache-mem-layout``) per host pool kind. SGLang's own resolution
# (``resolve_layout_io_compatibility``) turns ``page_first_direct`` + kernel into direct and ``page_first``
# + direct into ``page_first_direct``, so each pair below is one the server runs as given.
KERNEL = "kernel"


def host_tier(config: ModelConfig) -> tuple[str, str]:
    """``(--hicache-mem-layout, --hicache-io-backend)`` of the config's HiCache tier. Each host pool kind
    runs every pair its transfer methods have a CPU copy for, one pair per config shape, so one
    ``--family sglang`` run (and every drawn config of that shape) covers them all:

    ==========================  ==========================  ===============================================
    shape                        page size 1                 paged
    ==========================  ==========================  ===============================================
    MHA                          page_first, kernel          page_head, kernel
    MLA                          layer_first, direct         page_first, kernel
    recurrent state (mamba)      page_first, kernel          page_first_direct, direct (mamba is page-first
                                                             only: ``MambaPoolHost`` asserts it)
    MiniMax sparse (K-only)      page_first, kernel          page_first_direct, direct (its index-K host pool
                                                             has no page_head layout)
    ==========================  ==========================  ===============================================

    MHA's layer-first direct copies run on the PD decode server's host_pool retraction (``host.py``), and a
    speculative mamba config keeps the direct pair (its draft layers ride the same host pools)."""
    paged = config.page_size > 1
    if config.has_mamba:
        return ("page_first_direct", IO_BACKEND) if paged or config.spec_draft_tokens else ("page_first", KERNEL)
    if config.latent:
        return ("page_first", KERNEL) if paged else (HOST_LAYOUT, IO_BACKEND)
    if paged and not storage_of(config).host_page_head:
        return "page_first_direct", IO_BACKEND
    return ("page_head", KERNEL) if paged else ("page_first", KERNEL)


def direct_tier(config: ModelConfig) -> tuple[str, str]:
    """The ``direct`` pair for the config's shape: what a release without a wanted tier runs."""
    return ("page_first_direct" if config.has_mamba or config.page_size > 1 else HOST_LAYOUT), IO_BACKEND


def tier_problem(config: ModelConfig, tier: tuple[str, str]) -> str | None:
    """Why this release's host pools would not run ``tier`` for ``config``, or None: probed in the host
    pool classes' own source (the layout in the buffer allocation, the backend in the load method)."""
    import inspect

    from poolfuzz.adapters.sglang.shims import import_module

    layout, io_backend = tier
    kinds = [("mla", "MLATokenToKVPoolHost") if config.latent else ("mha", "MHATokenToKVPoolHost")]
    if config.has_mamba:
        kinds.append(("mamba", "MambaPoolHost"))
    for module_name, cls_name in kinds:
        # pool_host.<kind> from 0.5.16; one memory_pool_host module before
        for where in (f"sglang.srt.mem_cache.pool_host.{module_name}", "sglang.srt.mem_cache.memory_pool_host"):
            try:
                source = inspect.getsource(getattr(import_module(where), cls_name))
                break
            except (ImportError, AttributeError, OSError, TypeError) as exc:
                missing = exc
        else:
            return f"this SGLang has no {cls_name} in pool_host.{module_name} or memory_pool_host to probe ({missing})"
        if f'"{layout}"' not in source:
            return f"this SGLang's {cls_name} has no {layout!r} host memory layout"
        # a class naming the layout but refusing it (0.5.14 and 0.5.15's MambaPoolHost: page_first_direct only)
        only = re.search(r"only supports layout='(\w+)'", source)
        if only and only.group(1) != layout:
            return f"this SGLang's {cls_name} only supports the {only.group(1)!r} host memory layout"
        if io_backend != IO_BACKEND and f'io_backend == "{io_backend}"' not in source:
            return f"this SGLang's {cls_name} has no {io_backend!r} I/O backend"
    return None


def resolved_tier(config: ModelConfig) -> tuple[tuple[str, str], str | None]:
    """The tier the adapter runs: :func:`host_tier`'s, or where the release declines it the ``direct``
    pair, with the reason."""
    wanted = host_tier(config)
    problem = tier_problem(config, wanted) if wanted != direct_tier(config) else None
    return (direct_tier(config), f"{wanted[0]} / {wanted[1]}: {problem}") if problem else (wanted, None)


def host_layout(config: ModelConfig) -> str:
    """The ``--hicache-mem-layout`` the adapter runs (see :func:`host_tier`)."""
    return resolved_tier(config)[0][0]


def install_cpu_host_tier() -> None:
    """The call-time stand-ins a host tier needs on a machine without CUDA (each is a no-op where SGLang's own
    kernels or register exist): the ``direct`` and ``kernel`` copies, the host register, and a CPU stream's
    ``synchronize``."""
    install_cpu_transfer_ops()
    install_cpu_kernel_ops()
    install_cpu_host_register()
    install_cpu_stream_synchronize()


def install_cpu_stream_synchronize() -> bool:
    """``torch.cpu.Stream.synchronize`` as a no-op where torch lacks it: CPU work is done when it returns. SGLang's
    L2 transfer engine synchronises its stream when a transfer raises (0.5.22's ``_submission``); without it the
    CPU run would report an ``AttributeError`` in place of the transfer's own error."""
    if hasattr(torch.cpu.Stream, "synchronize"):
        return False
    torch.cpu.Stream.synchronize = lambda self: None
    return True


def hicache_flags(config: ModelConfig) -> dict:
    """The server arguments ``--enable-hierarchical-cache`` sets for ``config``'s tree (``ServerArgs`` fields)."""
    (layout, io_backend), _ = resolved_tier(config)
    return dict(enable_hierarchical_cache=True, hicache_ratio=HOST_RATIO, hicache_io_backend=io_backend,
                hicache_mem_layout=layout, hicache_write_policy=WRITE_POLICY)


@contextmanager
def hicache_arguments(config: ModelConfig):
    """The server arguments ``--enable-hierarchical-cache`` sets (:func:`hicache_flags`), scoped to the tree's build."""
    from poolfuzz.adapters.sglang.compat import memory_flags

    flags = hicache_flags(config)
    install_cpu_host_tier()
    with memory_flags(**flags):
        yield


def register_kernel_buffers(tree) -> None:
    """Make the tree's host and device pools addressable by the ``kernel`` copies (``kernel_io``); on a
    machine without CUDA, also unpin them: a host pool allocates each L3 page's bounce buffer
    (``get_dummy_flat_data_page``) with its ``pin_memory``, which CPU-only torch refuses, as it has no
    pinned memory to give (the register stand-in above is the same fact at build time)."""
    for host_pool, device_pool in host_tier_pools(tree):
        register_buffers(host_pool, device_pool)
        if not torch.cuda.is_available() and getattr(host_pool, "pin_memory", False):
            host_pool.pin_memory = False


def worker_standin(**asked):
    """The one call the tree makes on the TP worker: registering the load-back layer counter, which
    the model's attention layers wait on; the adapter's forward waits for the whole load instead. ``asked``: what
    else the caller's tree build reads of the worker (0.5.12's ``init_cache_with_memory_pool``)."""
    return types.SimpleNamespace(register_hicache_layer_transfer_counter=lambda counter: None, **asked)
