"""HiCache through SGLang's own tree (adapters/sglang/host_tier/hicache.py): write-through, demotion, load-back."""

from __future__ import annotations

import pytest

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import served_pressed_continued


@pytest.fixture
def hicache_api(api):
    from poolfuzz.adapters.sglang.host_tier.hicache import hicache_problem
    from poolfuzz.adapters.sglang.tree.trees import tree_problem

    # HiCache is built into SGLang's tree: a release whose tree is not driven has no host tier here
    problem = tree_problem(api, CONFIGS["dense"]) or hicache_problem(api, CONFIGS["dense"], pd_decode=False)
    if problem:
        pytest.skip(f"this release's HiCache is not driven: {problem}")
    return api


def _engine(name: str):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine

    return Engine(config=CONFIGS[name], family_factory=build_family)


def _spy_load_backs(fam) -> list[tuple[int, int]]:
    """(host tokens promised, tokens loaded) of every ``init_load_back`` the adder calls."""
    calls: list[tuple[int, int]] = []
    real = fam.tree.init_load_back

    def spy(params):
        out = real(params)
        calls.append((params.host_hit_length, 0 if out is None else out[0]))
        return out

    fam.tree.init_load_back = spy
    return calls


def _demoted_then_continued(e):
    """The chat demoted to the host and continued: its prefix is matched on the host and loaded back."""
    return served_pressed_continued(e)


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "mla", "mla-ps4", "hybrid-linear"])
def test_a_demoted_prefix_is_loaded_back_and_reads_right(hicache_api, name):
    from poolfuzz.adapters.sglang.host_tier.hicache import host_layout

    e = _engine(name)
    fam = e.families["prefill"]
    assert fam.hierarchical and fam.tree.cache_controller is not None
    layouts = {entry.host_pool.layout for entry in fam.tree.host_pool_group.entries}
    assert layouts == {host_layout(CONFIGS[name])}
    calls = _spy_load_backs(fam)
    _demoted_then_continued(e)
    ps = CONFIGS[name].page_size
    assert calls and calls[0][0] == calls[0][1] >= 20 // ps * ps - ps  # the chat's prefix, all of it
    e.sweep()
    e.drain()


def test_the_decode_server_has_no_host_tier(hicache_api):
    """A PD decode server backs retractions up into its host pool instead (host.py)."""
    from poolfuzz.adapters.sglang import build_family

    assert not build_family(CONFIGS["dense"], node="decode").hierarchical


# --- injected defects in SGLang's own host pool: the checksums must see them ---------------------
def test_a_host_pool_that_skips_a_layer_on_load_back_is_caught(hicache_api, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mha

    real = mha.MHATokenToKVPoolHost.load_to_device_per_layer
    last = max(CONFIGS["dense"].full_layer_ids)

    def skips_last_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        if layer_id != last:
            real(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw)

    monkeypatch.setattr(mha.MHATokenToKVPoolHost, "load_to_device_per_layer", skips_last_layer)
    e = _engine("dense")
    with pytest.raises(PoolfuzzFailure, match=rf"StateLost: req \d+ .*component full\.[kv] layer {last} "):
        _demoted_then_continued(e)


def test_a_write_through_that_drops_a_token_is_caught(hicache_api, monkeypatch):
    from sglang.srt.mem_cache.pool_host import mha

    real = mha.MHATokenToKVPoolHost.backup_from_device_all_layer

    def drops_last_token(self, device_pool, host_indices, device_indices, io_backend, **kw):
        real(self, device_pool, host_indices[:-1], device_indices[:-1], io_backend, **kw)

    monkeypatch.setattr(mha.MHATokenToKVPoolHost, "backup_from_device_all_layer", drops_last_token)
    e = _engine("dense")
    # the host copy is caught when it is stored in L3 (host.full.*), or else when loaded back
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req \d+ .*component (host\.)?full\.[kv] layer \d+ "):
        _demoted_then_continued(e)


def test_fuzzing_dense_with_hicache_passes(hicache_api, fuzz):
    outcome = fuzz(CONFIGS["dense"], examples=15)
    assert outcome.failure is None, outcome.failure
