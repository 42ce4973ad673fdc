"""The zero-copy storage stand-in below SGLang's HiCache server (adapters/sglang/host_tier/zero_copy.py): paged
configs store and prefetch through the host pool's own page meta (``get_page_buffer_meta``, or the head-split one of a
``page_head`` layout), and a meta that points at the wrong bytes is caught, by the runner where a prefetched page is
attended, or by the stand-in where it points past the host buffer."""

from __future__ import annotations

import re

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import LostKv
from tests.sglang.servers import server_module


@pytest.fixture(scope="module")
def hicache_server(scheduling):
    """The HiCache server's module, where this release's tree can be given a host tier here (else the test skips)."""
    return server_module("hicache_server", "dense")


def _zero_copy_driver(hicache_server, name):
    """The HiCache server of ``name`` with its L3 tier on the zero-copy stand-in, or the test skipped."""
    from poolfuzz.adapters.sglang.host_tier.zero_copy import CLASS_NAME

    if why := hicache_server.unsupported_reason(CONFIGS[name]) or hicache_server.storage_problem(CONFIGS[name]):
        pytest.skip(why)
    driver = hicache_server.SglangHiCacheDriver(CONFIGS[name])
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


def _traffic(driver, steps: int = 200) -> None:
    """The HiCache server tests' shared-prefix traffic (seeded): prefixes leave the device, then the host, and come
    back from storage."""
    import random

    draw = random.Random(2)
    for i in range(steps):
        if i % 2 == 0:
            driver.add_request(length=draw.randint(4, 30), share=draw.randint(0, 5), max_tokens=draw.randint(1, 8))
        driver.step()


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
    _traffic(driver)
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
        _traffic(driver)
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
        _traffic(driver)
    driver.close()
