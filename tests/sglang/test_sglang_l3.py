"""HiCache's L3 storage tier as SGLang's HiCache server is given it (adapters/sglang/host_tier/l3.py): which backend
a tree stores through, and where its files live."""

from __future__ import annotations

import os

import pytest

from poolfuzz.pools.config import CONFIGS


@pytest.mark.parametrize("name", ["swa-ps4", "swa", "hybrid-linear"])
def test_a_tree_with_pools_beside_the_kv_stores_through_sglangs_file_backend(api, name, tmp_path):
    """A sliding window's host pool (or mamba state's) sits beside the KV: SGLang's hybrid controller then queries
    the store with ``batch_exists_v2``, which the zero-copy stand-in lacks. 0.5.22 and 0.5.23 log that and count 0
    hits, so a SWA config's L3 tier never hit (0.5.21's prefetch thread died of it: StorageHang); such a tree takes
    SGLang's file backend."""
    from poolfuzz.adapters.sglang.host_tier import l3

    backend, extra = l3.storage_backend(CONFIGS[name], str(tmp_path), "page_first")
    assert (backend, extra) == (l3.BACKEND, {"file_storage_path": str(tmp_path)})


def test_sglangs_file_backend_keeps_its_pages_in_the_servers_own_directory(api, monkeypatch):
    """Each server's L3 files live in its own directory, on every release: 0.5.21's ``HiCacheFile`` reads only
    ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` (sglang#33883 added ``file_storage_path`` in 0.5.22), and without
    it every server on the machine shared ``/tmp/hicache``: an example prefetched pages another had stored (another
    config's, of another size), which read as lost KV and made Hypothesis's replays flaky."""
    from poolfuzz.adapters.sglang.host_tier import l3
    from poolfuzz.adapters.sglang.scheduler.hicache_server import (build_hicache_driver, storage_problem,
                                                                   unsupported_reason)

    # a HiCache server without an L3 tier here has no storage backend (0.5.18: its tree has no L3 entry points)
    if why := unsupported_reason(CONFIGS["hybrid-linear"]) or storage_problem(CONFIGS["hybrid-linear"]):
        pytest.skip(why)
    monkeypatch.delenv(l3.FILE_DIRECTORY_VARIABLE, raising=False)
    drivers = [build_hicache_driver(CONFIGS["hybrid-linear"]) for _ in range(2)]
    try:
        paths = [d.tree.cache_controller.storage_backend.file_path for d in drivers]
        assert paths == [d.storage_dir for d in drivers] and paths[0] != paths[1]
        assert l3.FILE_DIRECTORY_VARIABLE not in os.environ  # set for the build only
        for d in drivers:
            d.add_request(length=12, share=0, max_tokens=1)
            d.drain()
        assert all(os.listdir(d.storage_dir) for d in drivers)  # each stored its own pages, where it was told
    finally:
        for d in drivers:
            d.close()
