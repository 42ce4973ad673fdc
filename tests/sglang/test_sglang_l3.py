"""HiCache's L3 storage tier through SGLang's own tree and ``file`` backend (adapters/sglang/host_tier/l3.py):
write-back of written-through pages, prefetch on arrival, the page audit, the per-example close."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import served_pressed_continued

# minimax-sparse-konly-ps4: a host group with an index-key pool beside the KV stores through the v2 pool
# interface (it took the zero-copy stand-in, which has none, until stop 27: SGLang logged the error, stored nothing)
STORED = ["dense", "dense-ps4", "mla", "mla-ps4", "hybrid-linear", "minimax-sparse-konly-ps4"]


@pytest.fixture
def l3_api(api):
    from poolfuzz.adapters.sglang.host_tier.hicache import hicache_problem
    from poolfuzz.adapters.sglang.host_tier.l3 import storage_problem
    from poolfuzz.adapters.sglang.tree.trees import tree_problem

    config = CONFIGS["dense"]
    problem = (tree_problem(api, config) or hicache_problem(api, config, pd_decode=False)
               or storage_problem(api, config))
    if problem:
        pytest.skip(f"this release's HiCache L3 tier is not driven: {problem}")
    return api


def _engine(name: str):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine

    return Engine(config=CONFIGS[name], family_factory=build_family)


def _spy_prefetches(monkeypatch) -> list[int]:
    """Tokens each arrival's prefetch read from storage."""
    from poolfuzz.adapters.sglang.host_tier import l3

    loaded: list[int] = []
    real = l3.prefetch

    def spy(tree, sg, common):
        got = real(tree, sg, common)
        loaded.append(got)
        return got

    monkeypatch.setattr(l3, "prefetch", spy)
    return loaded


def _stored_evicted_continued(e) -> int:
    """The chat served, finished and backed up into storage; then the idle server's flush of its device
    tree and its host tier, so the chat's prefix is held by storage only; then the chat's next turn, which
    prefetches it. Returns its rid."""
    fam = e.families["prefill"]

    def only_storage_holds_the_chat():
        fam.flush_prefix_cache()
        e.refs["prefill"].flush_prefix_cache()
        fam.tree.evict_host(fam.config.full_tokens * 4)  # every host page

    return served_pressed_continued(e, before_next_turn=only_storage_holds_the_chat)


@pytest.mark.parametrize("name", STORED)
def test_a_prefix_held_only_by_storage_is_prefetched_and_reads_right(l3_api, name, monkeypatch):
    loaded = _spy_prefetches(monkeypatch)
    e = _engine(name)
    fam = e.families["prefill"]
    assert fam.tree.enable_storage and os.listdir(fam.storage_dir) == []
    _stored_evicted_continued(e)
    ps = CONFIGS[name].page_size
    assert loaded[-1] >= 20 // ps * ps - ps, loaded  # the next turn's prefix came back from storage
    assert len(fam.storage_reader.read) >= 20 // ps  # every stored page of the chat was read back and checked
    e.sweep()
    e.drain()
    directory = fam.storage_dir
    e.close()
    assert not os.path.exists(directory)


def test_closing_the_engine_stops_the_storage_threads(l3_api):
    before = set(threading.enumerate())
    e = _engine("dense")
    started = set(threading.enumerate()) - before
    assert len(started) >= 4  # prefetch, prefetch I/O, prefetch sync, backup
    e.sweep()
    e.drain()
    e.close()
    assert not [t for t in started if t.is_alive()]


def test_the_decode_server_and_swa_configs_have_no_storage_tier(l3_api):
    from poolfuzz.adapters.sglang import build_family

    assert getattr(build_family(CONFIGS["dense"], node="decode"), "storage_dir", None) is None
    assert getattr(build_family(CONFIGS["swa"]), "storage_dir", None) is None


# --- injected defects in SGLang's own storage path: the checks must see each one, and name it --------
def _host_cls(name: str):
    from sglang.srt.mem_cache.pool_host import mha, mla

    return mla.MLATokenToKVPoolHost if CONFIGS[name].latent else mha.MHATokenToKVPoolHost


# the copying interface runs on the page-size-1 configs (``l3.storage_backend``)
@pytest.mark.parametrize("name", ["dense", "mla"])
def test_a_page_stored_under_the_next_pages_key_is_caught_when_stored(l3_api, name, monkeypatch):
    e = _engine(name)  # SGLang's modules are importable once a family is built
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    real = HiCacheFile.batch_set

    def rotated_keys(self, keys, values=None, *args, **kwargs):
        return real(self, keys[1:] + keys[:1], values, *args, **kwargs)

    monkeypatch.setattr(HiCacheFile, "batch_set", rotated_keys)
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req 1 stored in L3 .* position 0; slot 0 holds req 1 pos "
                                               r"\d+ .*\(expected req 1 pos 0\)"):
        _stored_evicted_continued(e)
    e.close()


def test_a_page_written_with_its_last_layer_missing_is_caught_and_the_layer_named(l3_api, monkeypatch):
    e = _engine("dense")
    cls = _host_cls("dense")
    real = cls.get_data_page
    last = max(CONFIGS["dense"].full_layer_ids)

    def without_last_layer(self, index, flat=True):
        page = real(self, index, flat=False).clone()
        page[0, :, -1] = 0  # page_first: [k | v, tokens, layers, heads, dim]: K of the last layer
        return page.flatten() if flat else page

    monkeypatch.setattr(cls, "get_data_page", without_last_layer)
    with pytest.raises(PoolfuzzFailure, match=rf"StateLost: req 1 stored in L3 .*component host\.full\.k layer {last} "
                                              r".*holds zeros"):
        _stored_evicted_continued(e)
    e.close()


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid-linear"])
def test_a_prefetch_into_the_wrong_host_slot_is_caught_on_the_device(l3_api, name, monkeypatch):
    e = _engine(name)
    cls = _host_cls(name)
    real = cls.set_from_flat_data_page

    def next_page(self, index, data_page):
        real(self, (index + self.page_size) % (self.size - self.size % self.page_size), data_page)

    monkeypatch.setattr(cls, "set_from_flat_data_page", next_page)
    layer_part = "mla.latent" if CONFIGS[name].latent else "full.k"
    first = CONFIGS[name].full_layer_ids[0]  # a Qwen3-Next's attention layer is the last of its interval
    with pytest.raises(PoolfuzzFailure, match=rf"StateLost: req \d+ continued; component {layer_part} layer {first} "
                                              r"position 0; .*\(expected req 1 pos 0\)"):
        _stored_evicted_continued(e)
    e.close()


def test_a_backup_that_never_returns_is_a_hang_that_says_where_the_thread_is(l3_api, monkeypatch):
    """A storage thread blocked in the backend: the hang names the thread and the frames it is blocked in, and
    that the other three are idle (a dead or stopped thread is said as such)."""
    from poolfuzz.adapters.sglang.host_tier import l3

    e = _engine("dense")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    released = threading.Event()
    real = HiCacheFile.batch_set

    def stuck_in_the_backend(self, *args, **kwargs):
        released.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HiCacheFile, "batch_set", stuck_in_the_backend)
    monkeypatch.setattr(l3, "SETTLE_SECONDS", 0.5)
    try:
        with pytest.raises(l3.StorageHang, match=r"(?s)1 backup\(s\) .* still in flight.*stop event set: False.*"
                                                 r"backup_thread: running at.*in stuck_in_the_backend.*"
                                                 r"prefetch_thread: running at"):
            served_pressed_continued(e)
    finally:
        released.set()
    e.close()


def test_fuzzing_dense_ps4_with_storage_passes(l3_api, fuzz):
    outcome = fuzz(CONFIGS["dense-ps4"], examples=15)
    assert outcome.failure is None, outcome.failure


# --- the zero-copy interface (zero_copy.py): SGLang's page meta decides every address ----------------
def _meta_method(name: str) -> str:
    """The host pool's meta the stand-in asks: split by heads on a page-head host (``tp_lcm_size``)."""
    from poolfuzz.adapters.sglang.host_tier.hicache import host_layout

    return "get_split_heads_page_buffer_meta" if host_layout(CONFIGS[name]) == "page_head" else "get_page_buffer_meta"


@pytest.mark.parametrize("name", ["dense-ps4", "mla-ps4", "dense-cpu-fp8"])
def test_the_zero_copy_configs_store_through_the_pools_meta(l3_api, name, monkeypatch):
    from poolfuzz.adapters.sglang.host_tier.zero_copy import CLASS_NAME

    e = _engine(name)
    controller = e.families["prefill"].tree.cache_controller
    assert type(controller.storage_backend).__name__ == CLASS_NAME
    assert controller.page_set_func == controller._page_set_zero_copy
    assert type(controller.storage_host_pool.allocator).__name__ == "ShmHostTensorAllocator"  # "allocator": "shm"
    assert controller.storage_backend.split_factor == (2 if _meta_method(name).startswith("get_split") else 1)
    cls, method = _host_cls(name), _meta_method(name)
    metas = []
    real = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, indices, *a: metas.append(len(indices)) or real(self, indices, *a))
    loaded = _spy_prefetches(monkeypatch)
    _stored_evicted_continued(e)
    assert metas and loaded[-1] >= 16  # pages went out and came back through the pool's own meta
    # The audit's read of a stored page holds that page only (it held a host buffer a page, and a long prompt's
    # audit ran out of memory), through one scratch buffer per store.
    backend, host = controller.storage_backend, controller.storage_host_pool
    pages = [backend.flat_page(key, host) for key in list(backend.objects)[:2]]
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in pages)
    assert pages[0].untyped_storage().nbytes() < host.kv_buffer.untyped_storage().nbytes()
    assert backend._scratch[0] is host
    e.close()


@pytest.mark.parametrize("name", ["dense-ps4", "mla-ps4"])
def test_a_page_meta_that_points_one_page_on_is_caught_when_stored(l3_api, name, monkeypatch):
    e = _engine(name)
    cls, method = _host_cls(name), _meta_method(name)
    real = getattr(cls, method)

    def one_page_on(self, indices, *args):
        ptrs, sizes = real(self, indices, *args)
        page_bytes = real(self, torch.arange(self.page_size, 2 * self.page_size), *args)[0][0] - real(
            self, torch.arange(self.page_size), *args)[0][0]
        return [p + page_bytes for p in ptrs], sizes

    monkeypatch.setattr(cls, method, one_page_on)
    part = "mla.latent" if CONFIGS[name].latent else "full.k"
    with pytest.raises(PoolfuzzFailure, match=rf"StateLost: req 1 stored in L3 .*component host\.{part} layer 0 "
                                              r"position 0; .*\(expected req 1 pos 0\)"):
        _stored_evicted_continued(e)
    e.close()


def test_a_head_split_meta_that_repeats_the_first_heads_is_caught(l3_api, monkeypatch):
    """Every part of a page-head page pointing at its first heads: the second half of the heads is never stored."""
    e = _engine("dense-ps4")
    cls = _host_cls("dense-ps4")
    real = cls.get_split_heads_page_buffer_meta

    def first_heads_only(self, indices, split_factor):
        ptrs, sizes = real(self, indices, split_factor)
        return [ptrs[i - i % (2 * split_factor) + i % 2] for i in range(len(ptrs))], sizes

    monkeypatch.setattr(cls, "get_split_heads_page_buffer_meta", first_heads_only)
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req 1 stored in L3 .*component host\.full\.k layer 0 "
                                              r"position 0; slot 0 holds req 1 pos 0 .*torn"):
        _stored_evicted_continued(e)
    e.close()


def test_a_page_meta_past_the_host_buffer_is_an_illegal_address(l3_api, monkeypatch):
    from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress

    e = _engine("mla-ps4")
    cls = _host_cls("mla-ps4")
    real = cls.get_page_buffer_meta

    def past_the_end(self, indices):
        ptrs, sizes = real(self, indices)
        return ptrs, [s + self.kv_buffer.numel() * self.kv_buffer.element_size() for s in sizes]

    monkeypatch.setattr(cls, "get_page_buffer_meta", past_the_end)
    with pytest.raises(IllegalAddress, match="past the end of its buffer"):
        _stored_evicted_continued(e)
    e.close()


@pytest.mark.parametrize("name", ["swa-ps4", "swa", "hybrid-linear"])
def test_a_tree_with_pools_beside_the_kv_stores_through_sglangs_file_backend(l3_api, name, tmp_path):
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
    from poolfuzz.adapters.sglang.scheduler.hicache_server import build_hicache_driver, unsupported_reason

    if unsupported_reason(CONFIGS["hybrid-linear"]):
        pytest.skip(unsupported_reason(CONFIGS["hybrid-linear"]))
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
