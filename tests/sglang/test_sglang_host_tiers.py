"""HiCache's host memory layouts and I/O backends through SGLang's own host pools (hicache.host_tier, kernel_io), on
SGLang's HiCache server (scheduler/hicache_server.py)."""

from __future__ import annotations

import inspect

import pytest

from poolfuzz.adapters.sglang import compat
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import LostKv
from tests.sglang.servers import shared_traffic

TIERED = ["dense", "dense-ps4", "mla", "mla-ps4", "hybrid-linear", "hybrid-spec"]


def _driver(hicache_server, name):
    if why := hicache_server.unsupported_reason(CONFIGS[name]):
        pytest.skip(why)
    return hicache_server.SglangHiCacheDriver(CONFIGS[name])


@pytest.mark.parametrize("name", TIERED)
def test_each_config_runs_its_tier_through_sglang_and_loads_back_right(hicache_server, name):
    from poolfuzz.adapters.sglang.host_tier.hicache import host_tier
    from poolfuzz.adapters.sglang.host_tier.kernel_io import CPU_KERNEL_OPS

    driver = _driver(hicache_server, name)
    layout, io_backend = host_tier(CONFIGS[name])
    tree = driver.tree
    # the tree's host pools as the release keeps them: 0.5.20 on, a UnifiedRadixCache's pool group; 0.5.18's
    # HiRadixCache, one host pool (compat.host_pools)
    assert {host.layout for host in compat.host_pools(tree)} == {layout}
    assert tree.cache_controller.io_backend == io_backend
    loads = []
    real = tree.init_load_back
    tree.init_load_back = lambda *a, **k: loads.append(a) or real(*a, **k)
    if io_backend == "kernel":  # the kernel copies are the ones that run
        import sys

        from poolfuzz.adapters.sglang.host_tier.kernel_io import host_pool_modules

        # where the release keeps its host pools: pool_host.mha/.mla/.mamba, or (0.5.16, 0.5.17: the mamba one)
        # memory_pool_host
        for host in compat.host_pools(tree):
            module = sys.modules[type(host).__module__]
            assert any(getattr(module, op, None) is CPU_KERNEL_OPS[op] for op in CPU_KERNEL_OPS), module
        mamba = [module for _, module in host_pool_modules() if hasattr(module, "transfer_kv_mamba_lf_pf")]
        assert mamba and all(m.transfer_kv_mamba_lf_pf is CPU_KERNEL_OPS["transfer_kv_mamba_lf_pf"] for m in mamba)
    shared_traffic(driver)
    assert loads, "no prefix was loaded back from the host"
    assert driver.drain() is None
    driver.close()


def test_the_mha_tiers_cover_both_kernel_layouts_and_the_mla_and_mamba_ones_both_backends():
    from poolfuzz.adapters.sglang.host_tier.hicache import host_tier

    tiers = {name: host_tier(CONFIGS[name]) for name in TIERED}
    assert {tiers["dense"], tiers["dense-ps4"]} == {("page_first", "kernel"), ("page_head", "kernel")}
    assert {tiers["mla"][1], tiers["mla-ps4"][1]} == {"direct", "kernel"}
    assert {tiers["hybrid-linear"][1], tiers["hybrid-spec"][1]} == {"direct", "kernel"}


# --- injected defects in SGLang's real host pools on the kernel layouts: the checksums see them ---------
def _page_stride_one_layer_short(monkeypatch, cls):
    """The host pool's page stride (``layout_dim``) one layer short: each token's top layer lands on the
    next token's first layer in the page-first host buffer."""
    real = cls.init_kv_buffer

    def short_stride(self):
        buffer = real(self)
        if self.layout == "page_first":
            self.layout_dim -= self.token_stride_size
        return buffer

    monkeypatch.setattr(cls, "init_kv_buffer", short_stride)


def test_an_mha_page_first_stride_one_layer_short_is_caught(hicache_server, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mha

    _page_stride_one_layer_short(monkeypatch, mha.MHATokenToKVPoolHost)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.[kv] layer \d+ position \d+: "):
        shared_traffic(_driver(hicache_server, "dense"))


def test_an_mla_page_first_stride_one_layer_short_is_caught(hicache_server, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mla

    _page_stride_one_layer_short(monkeypatch, mla.MLATokenToKVPoolHost)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: mla\.\w+ layer \d+ position \d+: "):
        shared_traffic(_driver(hicache_server, "mla-ps4"))


def test_a_page_head_load_that_reads_one_head_for_all_is_caught(hicache_server, monkeypatch):
    """A load-back that tells the kernel the host holds one head a token (page_head's head stride lost)."""
    from sglang.srt.mem_cache.pool_host import mha

    real = mha.transfer_kv_per_layer_ph_lf

    def one_head(**kw):
        real(**{**kw, "head_num": 1})

    monkeypatch.setattr(mha, "transfer_kv_per_layer_ph_lf", one_head)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.[kv] layer \d+ position \d+: "):
        shared_traffic(_driver(hicache_server, "dense-ps4"))


def test_this_release_runs_every_wanted_tier_and_a_missing_layout_is_declined_with_its_reason(scheduling,
                                                                                               monkeypatch):
    from sglang.srt.mem_cache.pool_host import mha

    from poolfuzz.adapters.sglang.host_tier import hicache

    for name in TIERED:
        assert hicache.resolved_tier(CONFIGS[name]) == (hicache.host_tier(CONFIGS[name]), None), name
    # a release whose MHA host pool has no page_head layout (probed in its source): dense-ps4 runs the
    # direct pair instead, and says why
    monkeypatch.setattr(inspect, "getsource",
                        lambda obj: "" if obj is mha.MHATokenToKVPoolHost else 'io_backend == "kernel"')
    tier, reason = hicache.resolved_tier(CONFIGS["dense-ps4"])
    assert tier == ("page_first_direct", "direct")
    assert "page_head / kernel" in reason and "no 'page_head' host memory layout" in reason
