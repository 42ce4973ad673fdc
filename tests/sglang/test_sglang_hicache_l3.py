"""The L3 storage tier below SGLang's HiCache server, with defects planted in its storage path: on the zero-copy
stand-in (adapters/sglang/host_tier/zero_copy.py) paged configs store and prefetch through the host pool's own page
meta, and a meta that points at the wrong bytes is caught, by the runner where a prefetched page is attended or by
the stand-in where it points past the host buffer; on SGLang's file backend a page filed under another's key is
caught where it is read, and a backup that never returns is a hang that says where the thread is."""

from __future__ import annotations

import re

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import LostKv
from tests.sglang.servers import shared_traffic


def _l3_driver(hicache_server, name):
    """The HiCache server of ``name`` with an L3 tier, or the test skipped with the reason it has none."""
    if why := hicache_server.unsupported_reason(CONFIGS[name]) or hicache_server.storage_problem(CONFIGS[name]):
        pytest.skip(why)
    return hicache_server.SglangHiCacheDriver(CONFIGS[name])


def _zero_copy_driver(hicache_server, name):
    """The HiCache server of ``name`` with its L3 tier on the zero-copy stand-in, or the test skipped."""
    from poolfuzz.adapters.sglang.host_tier.zero_copy import CLASS_NAME

    driver = _l3_driver(hicache_server, name)
    controller = driver.tree.cache_controller
    assert type(controller.storage_backend).__name__ == CLASS_NAME
    assert controller.page_set_func == controller._page_set_zero_copy
    return driver


def _host_cls(name: str):
    from sglang.srt.mem_cache.pool_host import mha, mla

    return mla.MLATokenToKVPoolHost if CONFIGS[name].latent else mha.MHATokenToKVPoolHost


def _meta_method(driver) -> str:
    """The host pool's meta the stand-in reads: a ``page_head`` layout splits each page by heads."""
    split = driver.tree.cache_controller.storage_backend.split_factor > 1
    return "get_split_heads_page_buffer_meta" if split else "get_page_buffer_meta"


@pytest.mark.parametrize("name", ["dense-ps4", "mla-ps4"])
def test_paged_configs_store_and_prefetch_through_the_host_pools_own_meta(hicache_server, monkeypatch, name):
    driver = _zero_copy_driver(hicache_server, name)
    cls, method = _host_cls(name), _meta_method(driver)
    metas, loaded = [], []
    real = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, indices, *a: metas.append(len(indices)) or real(self, indices, *a))
    tree_cls = type(driver.tree)
    pop = tree_cls.pop_prefetch_loaded_span

    def counted(self, handle):
        out = pop(self, handle)
        loaded.append(int(out[0] or 0))
        return out

    monkeypatch.setattr(tree_cls, "pop_prefetch_loaded_span", counted)
    shared_traffic(driver)
    assert metas and sum(loaded) > 0  # pages went out and came back through the pool's own meta
    assert driver.drain() is None
    driver.close()


@pytest.mark.parametrize("name", ["dense-ps4", "mla-ps4"])
def test_a_page_meta_that_points_one_page_on_is_caught_where_the_prefetched_page_is_read(hicache_server, monkeypatch,
                                                                                         name):
    """Every stored page taken from the page after it: a request admitted on the prefetched prefix attends to
    another position's K, and the runner names the request, component, layer and position; or, first, the host
    pool's last page is taken from past its buffer, which the stand-in refuses as the GPU would fault."""
    from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress

    driver = _zero_copy_driver(hicache_server, name)
    cls, method = _host_cls(name), _meta_method(driver)
    real = getattr(cls, method)

    def one_page_on(self, indices, *args):
        ptrs, sizes = real(self, indices, *args)
        page_bytes = (real(self, torch.arange(self.page_size, 2 * self.page_size), *args)[0][0]
                      - real(self, torch.arange(self.page_size), *args)[0][0])
        return [p + page_bytes for p in ptrs], sizes

    monkeypatch.setattr(cls, method, one_page_on)
    part = r"mla\.latent" if CONFIGS[name].latent else r"full\.k"
    with pytest.raises((LostKv, IllegalAddress)) as caught:
        shared_traffic(driver)
    if caught.type is LostKv:
        assert re.match(rf"^req \d+ step \d+: {part} layer \d+ position \d+: ", str(caught.value)), caught.value
    else:
        assert "is in no registered host or device pool buffer" in str(caught.value), caught.value
    driver.close()


def test_a_page_meta_past_the_host_buffer_is_an_illegal_address(hicache_server, monkeypatch):
    from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress

    driver = _zero_copy_driver(hicache_server, "mla-ps4")
    cls = _host_cls("mla-ps4")
    real = cls.get_page_buffer_meta

    def past_the_end(self, indices):
        ptrs, sizes = real(self, indices)
        return ptrs, [s + self.kv_buffer.numel() * self.kv_buffer.element_size() for s in sizes]

    monkeypatch.setattr(cls, "get_page_buffer_meta", past_the_end)
    with pytest.raises(IllegalAddress, match="past the end of its buffer"):
        shared_traffic(driver)
    driver.close()


# --- SGLang's file backend (page-size-1 configs): planted defects in its storage path ----------------
def _file_backend_driver(hicache_server, name):
    """The HiCache server of ``name`` with its L3 tier on SGLang's own file backend, or the test skipped."""
    from poolfuzz.adapters.sglang.host_tier import l3

    driver = _l3_driver(hicache_server, name)
    if type(driver.tree.cache_controller.storage_backend).__name__ != "HiCacheFile":
        driver.close()
        pytest.skip(f"{name}'s L3 tier is not SGLang's file backend here ({l3.BACKEND})")
    return driver


@pytest.mark.parametrize("name", ["dense", "mla"])
def test_a_page_stored_under_the_next_pages_key_is_caught_where_it_is_read(hicache_server, monkeypatch, name):
    """The file backend files each page under its neighbour's hash: a request admitted on the prefetched prefix
    attends to another position's K, and the runner names it."""
    driver = _file_backend_driver(hicache_server, name)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    real = HiCacheFile.batch_set

    def rotated_keys(self, keys, values=None, *args, **kwargs):
        return real(self, keys[1:] + keys[:1], values, *args, **kwargs)

    monkeypatch.setattr(HiCacheFile, "batch_set", rotated_keys)
    part = r"mla\.latent" if CONFIGS[name].latent else r"full\.k"
    with pytest.raises(LostKv, match=rf"^req \d+ step \d+: {part} layer \d+ position \d+: "):
        shared_traffic(driver)
    driver.close()


def test_a_backup_that_never_returns_is_a_hang_that_says_where_the_thread_is(hicache_server, monkeypatch):
    """A storage thread blocked in the backend: the server would wait for ever; the hang is reported, naming the
    thread and the frames it is blocked in, and that the prefetch thread is running."""
    import threading

    from poolfuzz.adapters.sglang.host_tier import l3

    driver = _file_backend_driver(hicache_server, "dense")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    released = threading.Event()
    real = HiCacheFile.batch_set

    def stuck_in_the_backend(self, *args, **kwargs):
        released.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HiCacheFile, "batch_set", stuck_in_the_backend)
    monkeypatch.setattr(l3, "SETTLE_SECONDS", 0.5)
    try:
        with pytest.raises(l3.StorageHang, match=r"(?s)backup\(s\) .* still in flight.*"
                                                 r"backup_thread: running at.*in stuck_in_the_backend.*"
                                                 r"prefetch_thread: running at"):
            shared_traffic(driver)
    finally:
        released.set()
    driver.close()
