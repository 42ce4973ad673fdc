"""HiCache's L3 storage tier on the CPU: SGLang's ``file`` backend, one temporary directory per tree.

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
the prefill adder like any host hit (``hicache.load_back``).

Four threads run this per tree. The adapter keeps them deterministic by settling after every poll:
:func:`settle` waits until every backup and prefetch handed to them has come back, and drains it, so
no storage operation is in flight between two steps (the ``wait_complete`` prefetch policy makes a
prefetch all-or-nothing, as the checks need). :func:`close` detaches the backend (SGLang's own
``shutdown``: drain, stop the threads, release what is still tracked) and removes the directory; the
family calls it when its example ends (``SGLangTreeFamily.close``).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import time
from contextlib import contextmanager

from poolfuzz.pools.config import ModelConfig

BACKEND = "file"  # the storage backend SGLang ships that needs no network
PREFETCH_POLICY = "wait_complete"  # a prefetch completes whole before its request is admitted
SETTLE_SECONDS = 30.0  # a storage operation not back by then is a hang: reported, never waited out


class StorageHang(RuntimeError):
    """A backup or prefetch the storage threads never finished (SGLang's scheduler would wait forever)."""


def storage_problem(api, config: ModelConfig) -> str | None:
    """Why the adapter does not back this config's HiCache tier up into L3 storage, or None."""
    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError:
        return f"SGLang {api.version} has no HiCache storage backends (mem_cache.storage.backend_factory)"
    if not all(hasattr(UnifiedRadixCache, m) for m in ("write_backup_storage", "prefetch_from_storage",
                                                       "check_prefetch_progress", "shutdown")):
        return f"SGLang {api.version}'s tree has no L3 entry points (write_backup_storage / prefetch_from_storage)"
    if BACKEND not in getattr(StorageBackendFactory, "_registry", {BACKEND: None}):
        return f"SGLang {api.version} registers no {BACKEND!r} storage backend"
    if config.has_mamba:
        # SGLang's file backend stores the KV pages only (batch_set); a mamba tree's state sidecar needs
        # the v2 pool interface, whose prefetch the hybrid check rejects when the state page is missing
        return "the recurrent-state sidecar of the L3 tier (v2 pool transfers) is not driven"
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


@contextmanager
def storage_arguments(config: ModelConfig, directory: str):
    """``--hicache-storage-backend file`` with its files in ``directory``, scoped to the tree's build.
    The prefetch threshold is one page (SGLang's default, 256 tokens, is past every context here)."""
    from sglang.srt.runtime_context import get_memory

    _single_rank()
    extra = json.dumps({"prefetch_threshold": config.page_size, "file_storage_path": directory})
    with get_memory().override(hicache_storage_backend=BACKEND, hicache_storage_backend_extra_config=extra,
                               hicache_storage_prefetch_policy=PREFETCH_POLICY):
        yield


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


def settle(tree) -> None:
    """Poll (``check_hicache_events``) until no storage operation is in flight."""
    deadline = time.monotonic() + SETTLE_SECONDS
    tree.check_hicache_events()
    while enabled(tree) and _in_flight(tree):
        if time.monotonic() > deadline:
            raise StorageHang(f"HiCache storage: {len(tree.ongoing_backup)} backup(s) and "
                              f"{len(tree.ongoing_prefetch)} prefetch(es) still in flight after {SETTLE_SECONDS:.0f} s")
        time.sleep(0.001)
        tree.check_hicache_events()


def prefetch(tree, sg, common) -> int:
    """The scheduler's ``_prefetch_kvcache`` for a request entering the queue, then its admission-time
    ``check_prefetch_progress`` / ``pop_prefetch_loaded_span``: what storage holds past the host's hit
    becomes host nodes of the tree. Returns the tokens read from storage."""
    if not enabled(tree):
        return 0
    common.match_kv_cache(sg, tree, cow_mamba=False)  # init_next_round_input(tree, cow_mamba=False)
    anchor = sg.last_host_node
    matched = int(sg.prefix_len) + int(sg.host_hit_length)
    if not (tree.is_backuped(anchor) or tree.is_root(anchor)):
        return 0  # an anchor not written through: its suffix cannot be in storage
    ids = sg.full_untruncated_fill_ids
    end = sg._compute_max_prefix_len(len(ids))
    prefix_keys = tree.get_prefix_hash_values(anchor) if tree.hicache_storage_pass_prefix_keys else None
    handle = sg.cache_request_handle
    tree.prefetch_from_storage(handle, anchor, ids[matched:end], tree.get_last_hash_value(anchor), prefix_keys,
                               matched_prefix_tokens=ids[:matched], extra_key=sg.extra_key, cache_salt=sg.cache_salt)
    deadline = time.monotonic() + SETTLE_SECONDS
    while not tree.check_prefetch_progress(handle):
        if time.monotonic() > deadline:
            raise StorageHang(f"HiCache storage: the prefetch of req {sg.rid} never completed")
        time.sleep(0.001)
        tree.check_hicache_events()
    loaded, _ = tree.pop_prefetch_loaded_span(handle)
    settle(tree)
    return int(loaded)


def close(tree, directory: str | None) -> None:
    """Detach the storage backend (SGLang's ``shutdown``: its threads stop) and remove its files."""
    shutdown = getattr(tree, "shutdown", None)
    if shutdown is not None:
        shutdown()
        atexit.unregister(shutdown)  # registered by init_hicache; the tree is done with
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
