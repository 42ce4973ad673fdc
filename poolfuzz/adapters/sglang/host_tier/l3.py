"""HiCache's L3 storage tier on the CPU: one storage backend per tree (SGLang's ``file`` backend in a
temporary directory of its own, or ``zero_copy``'s stand-in for the zero-copy interface: :func:`storage_backend`).

A server started with ``--hicache-storage-backend file`` backs every node the tree writes through to
the host up into storage as well: when the write-through's ack comes in (``writing_check``), the tree
calls ``write_backup_storage(node)``, which hands the node's host pages and their page hashes (a chain:
each page's hash covers every token before it) to the controller's backup thread; the thread copies
each page out of the host pool (``get_data_page``) into a file named by its hash, and the next poll's
``drain_storage_control_queues`` releases the node's host lock. A request that arrives with a prefix
the device and the host no longer hold, but storage does, is prefetched: the scheduler's
``_prefetch_kvcache`` (``prefetch_from_storage`` from the deepest host node, with that node's last page
hash), then, each step, ``check_prefetch_progress`` until the prefetch thread has found the pages
(``batch_exists``), the tree has given it host slots and the I/O thread has read each page into its slot
(``set_from_flat_data_page``); the pages are then host nodes of the tree, loaded back to the device by
the prefill adder like any host hit.

Four threads run this per tree. The adapter keeps them deterministic by settling after every poll:
:func:`settle` waits until every backup and prefetch handed to them has come back, and drains it, so
no storage operation is in flight between two steps (the ``wait_complete`` prefetch policy makes a
prefetch all-or-nothing, as the checks need). :func:`close` detaches the backend (SGLang's own
``shutdown``: drain, stop the threads, release what is still tracked) and removes the directory; the
HiCache server calls it when its example ends.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager

from poolfuzz.adapters.sglang.host_tier import zero_copy
from poolfuzz.adapters.sglang.compat import has_private, registered_storage_backends
from poolfuzz.adapters.sglang.pools.storage import storage_of
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.environment import environment_set

BACKEND = "file"  # the storage backend SGLang ships that needs no network
FILE_DIRECTORY_VARIABLE = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # where HiCacheFile keeps its files (its __init__)
PREFETCH_POLICY = "wait_complete"  # a prefetch completes whole before its request is admitted
# --hicache-ratio with an L3 tier below the host: the host is a staging tier a little larger than the device
# (SGLang warns at or below 1), so written-through prefixes leave it, and come back through storage, within
# the few dozen steps of an example (at SGLang's default 2 they seldom leave it at all)
HOST_RATIO = 1.25
SETTLE_SECONDS = 30.0  # a storage operation not back by then is a hang: reported, never waited out


class StorageHang(RuntimeError):
    """A backup or prefetch the storage threads never finished (SGLang's scheduler would wait forever)."""


def storage_problem(api, config: ModelConfig) -> str | None:
    """Why the adapter does not back this config's HiCache tier up into L3 storage, or None."""
    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401 - a probe
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError:
        return f"SGLang {api.version} has no HiCache storage backends (mem_cache.storage.backend_factory)"
    if not all(hasattr(UnifiedRadixCache, m) for m in ("write_backup_storage", "prefetch_from_storage",
                                                       "check_prefetch_progress", "shutdown")):
        return f"SGLang {api.version}'s tree has no L3 entry points (write_backup_storage / prefetch_from_storage)"
    if has_private("storage_registry") and BACKEND not in registered_storage_backends():
        return f"SGLang {api.version} registers no {BACKEND!r} storage backend"
    return None


def _single_rank() -> None:
    """The controller reads the tensor- and pipeline-parallel place of its rank to key the files: where
    no launcher wrote it, state the single rank a CPU run is."""
    from sglang.srt.runtime_context import get_parallel

    ctx = get_parallel()
    unset = {}
    for name, value in (("tp_rank", 0), ("tp_size", 1), ("pp_rank", 0), ("pp_size", 1), ("attn_cp_rank", 0),
                        ("attn_cp_size", 1), ("attn_tp_rank", 0), ("attn_tp_size", 1), ("attn_dp_rank", 0)):
        try:
            getattr(ctx, name)
        except (RuntimeError, ValueError):
            unset[name] = value
        except AttributeError:  # a release whose context has no such width reads none
            pass
    if unset:
        ctx.override_permanently(**unset)


def storage_backend(config: ModelConfig, directory: str, layout: str) -> tuple[str, dict]:
    """``(--hicache-storage-backend, its extra config)``: SGLang's ``file`` backend, whose copying interface
    reads and writes flat pages (``get_data_page`` / ``set_from_flat_data_page``), or the zero-copy interface
    that real L3 engines use (``get_page_buffer_meta``; split by heads on a ``page_head`` host), through
    ``zero_copy``'s stand-in. Each host layout runs both across the configs: a KV-only config takes the
    zero-copy one when it is paged, and its KV-quantised twin (same host layout) the other way round. A tree
    whose host group has pools beside the KV (mamba state, MiniMax's index keys) keeps the file backend: those
    go through the v2 pool interface, which the stand-in does not offer (:func:`_has_side_pools`).

    ==========================  ===============================  ==================================
    config                       page size 1                      paged
    ==========================  ===============================  ==================================
    MHA, MLA                     file                             zero-copy (page_head: head split)
    MHA with a KV quant method   zero-copy                        file
    mamba                        file                             (no tree at page size > 1)
    MiniMax sparse (index keys)  file                             file
    ==========================  ===============================  ==================================

    (``layout``: the host's ``--hicache-mem-layout``.)
    """
    if not _has_side_pools(config) and (config.page_size > 1) != bool(config.kv_quant):
        return zero_copy.BACKEND, zero_copy.extra_config(layout=layout, head_num=config.head_num)
    return BACKEND, {"file_storage_path": directory}


def _has_side_pools(config: ModelConfig) -> bool:
    """Whether the host group holds pools beside the KV (mamba state, the sliding window's, MiniMax's sparse index
    keys): SGLang's hybrid controller then stores and queries through the v2 pool interface (``batch_set_v2`` /
    ``batch_exists_v2``), which the zero-copy stand-in does not offer; SGLang logs the ``NotImplementedError`` and
    stores nothing (0.5.21's prefetch thread dies of it), so such a tree takes the file backend."""
    return config.has_mamba or config.has_swa or storage_of(config).host_side_pools


def storage_flags(config: ModelConfig, directory: str, layout: str) -> dict:
    """The server arguments of the L3 tier (``ServerArgs`` fields): ``--hicache-storage-backend`` (``file`` with its
    files in ``directory``, or the zero-copy stand-in: :func:`storage_backend`), its extra config, the
    ``wait_complete`` prefetch policy and the host ratio of :data:`HOST_RATIO`. The prefetch threshold is one page
    (SGLang's default, 256 tokens, is past every context here)."""
    backend, extra = storage_backend(config, directory, layout)
    return dict(hicache_storage_backend=backend,
                hicache_storage_backend_extra_config=json.dumps(dict(extra, prefetch_threshold=config.page_size)),
                hicache_storage_prefetch_policy=PREFETCH_POLICY, hicache_ratio=HOST_RATIO)


@contextmanager
def storage_arguments(config: ModelConfig, directory: str, layout: str):
    """:func:`storage_flags`, scoped to the tree's build."""
    from poolfuzz.adapters.sglang.compat import memory_flags

    _single_rank()
    # the file backend's directory also as its variable: releases before 0.5.22 (sglang#33883) read only the variable
    # (else /tmp/hicache, shared by every server on the machine: a run's examples hit each other's pages)
    with memory_flags(**storage_flags(config, directory, layout)), \
            environment_set({FILE_DIRECTORY_VARIABLE: directory}):
        yield


def warm_page_hash() -> None:
    """SGLang's page hash computed once, on the main thread, before a server with an L3 tier takes its first request.

    From 0.5.16 the hash is a C++ extension that torch compiles the first time a process hashes
    (``mem_cache/utils.get_hash_str`` -> ``get_native_hash``): left to the prefetch thread, that build (over 30 s on a
    loaded machine: stop 70 met it as a false ``StorageHang`` on 0.5.19) would run under :data:`SETTLE_SECONDS` and read
    as a hang. Built here, a build that fails is a crash at the server's start, and the deadline times storage only."""
    from sglang.srt.mem_cache.utils import get_hash_str

    get_hash_str([0])


def new_directory() -> str:
    return tempfile.mkdtemp(prefix="poolfuzz-l3-")


def enabled(tree) -> bool:
    return bool(getattr(tree, "enable_storage", False))


# =============================================================================================
# The scheduler's calls, settled
# =============================================================================================
def _in_flight(tree) -> bool:
    """Whether a backup or prefetch is still with the storage threads (or back and not yet drained)."""
    cc = tree.cache_controller
    queues = (cc.backup_queue, cc.prefetch_queue, cc.prefetch_buffer, cc.prefetch_sync_queue,
              cc.prefetch_hit_queue, cc.ack_prefetch_queue, cc.ack_backup_queue)
    return bool(tree.ongoing_backup or tree.ongoing_prefetch or any(q.qsize() for q in queues))


STORAGE_THREADS = ("backup_thread", "prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread")


def threads_report(controller) -> str:
    """Where each of the controller's storage threads is: dead, or the innermost frames it is running, so a
    hang says whether a thread died, stopped, or is blocked (and on what)."""
    frames = sys._current_frames()
    lines = [f"stop event set: {controller.storage_stop_event.is_set()}; "
             f"backup queue {controller.backup_queue.qsize()}, ack queue {controller.ack_backup_queue.qsize()}"]
    for name in STORAGE_THREADS:
        thread = getattr(controller, name, None)
        if thread is None:
            lines.append(f"{name}: never started")
        elif not thread.is_alive():
            lines.append(f"{name}: not running")
        else:
            frame = frames.get(thread.ident)
            where = traceback.format_stack(frame, limit=4) if frame is not None else ["(no frame)"]
            lines.append(f"{name}: running at\n" + "".join(where).rstrip())
    return "\n".join(lines)


def settle(tree) -> None:
    """Poll (``check_hicache_events``) until no storage operation is in flight."""
    deadline = time.monotonic() + SETTLE_SECONDS
    tree.check_hicache_events()
    while enabled(tree) and _in_flight(tree):
        if time.monotonic() > deadline:
            raise StorageHang(f"HiCache storage: {len(tree.ongoing_backup)} backup(s) and "
                              f"{len(tree.ongoing_prefetch)} prefetch(es) still in flight after {SETTLE_SECONDS:.0f} s\n"
                              + threads_report(tree.cache_controller))
        time.sleep(0.001)
        tree.check_hicache_events()
    faults = getattr(tree.cache_controller.storage_backend, "faults", None) if enabled(tree) else None
    if faults:  # a zero-copy address outside the host pools (``zero_copy``): the process would be dead
        raise faults.pop(0)


def close(tree, directory: str | None) -> None:
    """The server's shutdown of a HiCache tree: detach the storage backend (the tree's ``atexit`` hook,
    ``shutdown``: its threads stop), then, as a scheduler's graceful exit does, release its host pools
    (``release_host_resources``: each host pool's ``destroy``); and remove the backend's files."""
    shutdown = getattr(tree, "shutdown", None)
    if shutdown is not None:
        shutdown()
        atexit.unregister(shutdown)  # registered by init_hicache; the tree is done with
    release = getattr(tree, "release_host_resources", None)
    if release is not None:
        release()
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
