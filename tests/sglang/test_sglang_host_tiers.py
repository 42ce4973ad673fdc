"""HiCache's host memory layouts and I/O backends through SGLang's own host pools (hicache.host_tier, kernel_io)."""

from __future__ import annotations

import inspect

import pytest

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import served_pressed_continued

TIERED = ["dense", "dense-ps4", "mla", "mla-ps4", "hybrid-linear", "hybrid-spec"]


@pytest.fixture
def hicache_api(api):
    from poolfuzz.adapters.sglang.host_tier.hicache import hicache_problem
    from poolfuzz.adapters.sglang.tree.trees import tree_problem

    problem = tree_problem(api, CONFIGS["dense"]) or hicache_problem(api, CONFIGS["dense"], pd_decode=False)
    if problem:
        pytest.skip(f"this release's HiCache is not driven: {problem}")
    return api


def _engine(name: str):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine

    return Engine(config=CONFIGS[name], family_factory=build_family)


def _served_demoted_continued(e) -> None:
    """A chat written through to the host, demoted by a larger request, then continued (loaded back)."""
    served_pressed_continued(e)


@pytest.mark.parametrize("name", TIERED)
def test_each_config_runs_its_tier_through_sglang_and_loads_back_right(hicache_api, name):
    from poolfuzz.adapters.sglang.host_tier.hicache import host_tier
    from poolfuzz.adapters.sglang.host_tier.kernel_io import CPU_KERNEL_OPS

    layout, io_backend = host_tier(CONFIGS[name])
    e = _engine(name)
    tree = e.families["prefill"].tree
    assert {entry.host_pool.layout for entry in tree.host_pool_group.entries} == {layout}
    assert tree.cache_controller.io_backend == io_backend
    loads = []
    real = tree.init_load_back
    tree.init_load_back = lambda params: loads.append(params) or real(params)
    if io_backend == "kernel":  # the kernel copies are the ones that run
        from sglang.srt.mem_cache.pool_host import mamba, mha, mla

        module = mla if CONFIGS[name].latent else mha
        assert any(getattr(module, op, None) is CPU_KERNEL_OPS[op] for op in CPU_KERNEL_OPS)
        assert mamba.transfer_kv_mamba_lf_pf is CPU_KERNEL_OPS["transfer_kv_mamba_lf_pf"]
    _served_demoted_continued(e)
    assert loads, "the next turn's prefix was not loaded back from the host"
    e.sweep()
    e.drain()


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


def test_an_mha_page_first_stride_one_layer_short_is_caught(hicache_api, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mha

    _page_stride_one_layer_short(monkeypatch, mha.MHATokenToKVPoolHost)
    # the host copy is caught when it is stored in L3 (host.full.*), or else when loaded back
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req \d+ .*component (host\.)?full\.[kv] layer \d+ "):
        _served_demoted_continued(_engine("dense"))


def test_an_mla_page_first_stride_one_layer_short_is_caught(hicache_api, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mla

    _page_stride_one_layer_short(monkeypatch, mla.MLATokenToKVPoolHost)
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req \d+ "):
        _served_demoted_continued(_engine("mla-ps4"))


def test_a_page_head_load_that_reads_one_head_for_all_is_caught(hicache_api, monkeypatch):
    """A load-back that tells the kernel the host holds one head a token (page_head's head stride lost)."""
    from sglang.srt.mem_cache.pool_host import mha

    real = mha.transfer_kv_per_layer_ph_lf

    def one_head(**kw):
        real(**{**kw, "head_num": 1})

    monkeypatch.setattr(mha, "transfer_kv_per_layer_ph_lf", one_head)
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req \d+ .*component full\.[kv] layer \d+ "):
        _served_demoted_continued(_engine("dense-ps4"))


def test_fuzzing_the_kernel_tiers_passes(hicache_api, fuzz):
    for name in ("dense", "dense-ps4", "mla-ps4", "hybrid-linear"):
        outcome = fuzz(CONFIGS[name], examples=8)
        assert outcome.failure is None, (name, outcome.failure)


def test_this_release_runs_every_wanted_tier_and_a_missing_layout_is_declined_with_its_reason(hicache_api,
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
