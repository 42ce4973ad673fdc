"""SGLang's MiniMax sparse KV pool (``minimax-sparse*``, adapters/sglang/pools/minimax.py): the release's own
MiniMaxSparseKVPool, written and read through its doors, its index caches checksummed; what SGLang refuses or
lacks for it (PD with index values, HiCache with index values, a CPU copy, a row move) is declined with
SGLang's own reason, and the CPU copy it lacks is shown to crash SGLang's retraction."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.engine_fuzz import fuzz_family


def _config(name):
    from poolfuzz.adapters.sglang import unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(why)
    return CONFIGS[name]


def _family(name):
    from poolfuzz.adapters.sglang import build_family

    return build_family(_config(name))


def test_sglangs_own_pool_and_every_index_cache_are_components(api):
    fam = _family("minimax-sparse")  # layers D V K V
    pool = fam.sg_kv_pool
    assert type(pool).__name__ == "MiniMaxSparseKVPool"
    assert pool.index_kv_pool is not None and pool.index_k_pool is not None
    names = {(c.name, c.layer): c.tensor for c in fam.components()}
    assert set(names) >= {("msa.index_k", 1), ("msa.index_v", 1), ("msa.index_k", 2), ("msa.index_k", 3)}
    assert ("msa.index_v", 2) not in names  # layer 2 keeps index keys only
    assert names[("msa.index_k", 2)].data_ptr() == pool.index_k_pool.k_buffer[0].data_ptr()
    assert names[("msa.index_v", 3)].data_ptr() == pool.index_kv_pool.v_buffer[1].data_ptr()


@pytest.mark.parametrize("name", ["minimax-sparse", "minimax-sparse-ps4", "minimax-sparse-konly",
                                  "minimax-sparse-konly-ps4"])
def test_the_release_passes_a_short_fuzz(api, name):
    """No false alarm; the K-only model's one known crash (a retraction on the PD decode node: the pool has
    no CPU copy, see the test below) is the only failure it may show."""
    try:
        outcome = fuzz_family(__import__("poolfuzz.adapters.sglang", fromlist=["build_family"]).build_family,
                              _config(name), examples=8)
    except NotImplementedError:  # raised by SGLang's retraction, shrunk by Hypothesis
        assert "konly" in name
        return
    assert outcome.failure is None, outcome.failure


def test_an_index_store_into_the_wrong_group_is_caught(api, monkeypatch):
    """SGLang's K-only store files a layer's index key under the K-only pool's first layer: the checksums of the
    other K-only layer's index keys say whose data they hold."""
    config = _config("minimax-sparse-konly")  # layers D K D K
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    def misfiled(self, layer, loc, cache_idx_k, k_scale=None):
        self.index_k_pool.set_k_buffer(0, loc, cache_idx_k)

    monkeypatch.setattr(MiniMaxSparseKVPool, "set_index_k_buffer", misfiled)
    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=config, family_factory=build_family)
    with pytest.raises(PoolfuzzFailure) as info:
        rid = e.admit(3)
        e.prefill(rid, 3)
        e.check()
    assert info.value.divergence.component == "msa.index_k", info.value


def test_what_sglang_refuses_for_index_values_is_declined_with_its_reason(api):
    fam = _family("minimax-sparse")
    assert not fam.supports_transfer and not fam.supports_retract
    assert "index_kv_pool" in fam.declined["transfer"] and "index_kv_pool" in fam.declined["retract"]
    if getattr(fam, "tree", None) is not None:  # HiCache's assembler refuses value-bearing index layers
        assert "hicache" in fam.declined and not fam.hierarchical


def test_the_k_only_model_transfers_and_keeps_its_host_tier(api):
    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=_config("minimax-sparse-konly"), family_factory=build_family)
    fam = e.families["prefill"]
    assert fam.supports_transfer and "transfer" not in fam.declined
    rid = e.admit(5)
    e.prefill(rid, 5)
    assert e.transfer(rid)
    e.check()
    if getattr(fam, "tree", None) is not None:
        assert fam.hierarchical and "hicache" not in fam.declined


def test_sglangs_retraction_of_a_k_only_minimax_request_crashes_and_poolfuzz_says_so(api):
    """A PD decode server of the K-only model (PD allowed) backs a retracted request up with SGLang's
    ``offload_kv_cache``, which calls ``get_cpu_copy``; MiniMaxSparseKVPool has none (``KVCache``'s stub raises
    NotImplementedError, sglang#32603 proposes one) and no SGLang check refuses the mode. poolfuzz adds no guard
    SGLang lacks: it reports the crash, on the decode node as SGLang runs it (ci/known/sglang-0.5.23.txt
    carries it as judged). When a release gives the pool a CPU copy, the retraction passes and the test skips."""
    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=_config("minimax-sparse-konly"), family_factory=build_family)
    rid = e.admit(3)
    e.prefill(rid, 3)
    if not e.transfer(rid):
        pytest.skip(f"SGLang {api.version}: the decode node takes no transfer here")
    fam = e.families["decode"]
    assert fam.supports_retract and "retract" not in fam.declined
    try:
        e.retract(rid)
    except NotImplementedError:
        return
    pytest.skip(f"SGLang {api.version}'s MiniMaxSparseKVPool has a CPU copy: the retraction passed")


@pytest.mark.parametrize("name", ["minimax-sparse-konly", "minimax-sparse-konly-ps4"])
def test_the_index_keys_come_back_from_the_host_tier(api, name):
    """HiCache's MiniMax stack (``build_minimax_sparse_hicache_stack``): the index keys ride their own host pool,
    SGLang's MHATokenToKOnlyPoolHost; a demoted chat's next turn loads them back and reads right."""
    from tests.sglang.test_sglang_hicache import _demoted_then_continued, _spy_load_backs

    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=_config(name), family_factory=build_family)
    fam = e.families["prefill"]
    if getattr(fam, "tree", None) is None or not fam.hierarchical:
        pytest.skip(f"this release's HiCache is not driven for {name}: {fam.declined.get('hicache') or 'no SGLang tree here'}")
    hosts = [type(entry.host_pool).__name__ for entry in fam.tree.host_pool_group.entries]
    assert hosts == ["MHATokenToKVPoolHost", "MHATokenToKOnlyPoolHost"]
    calls = _spy_load_backs(fam)
    _demoted_then_continued(e)
    assert calls and calls[0][0] == calls[0][1] > 0
    e.sweep()
    e.drain()


def test_a_k_only_host_pool_that_skips_a_layer_on_load_back_is_caught(api, monkeypatch):
    from tests.sglang.test_sglang_hicache import _demoted_then_continued

    from poolfuzz.adapters.sglang import build_family

    config = _config("minimax-sparse-konly")  # layers D K D K: the K-only pool's local layers 0 and 1
    from sglang.srt.mem_cache.pool_host import mha

    real = mha.MHATokenToKOnlyPoolHost.load_to_device_per_layer

    def skips_last_layer(self, device_pool, host_indices, device_indices, layer_id, *a, **kw):
        if layer_id != self.layer_num - 1:
            real(self, device_pool, host_indices, device_indices, layer_id, *a, **kw)

    monkeypatch.setattr(mha.MHATokenToKOnlyPoolHost, "load_to_device_per_layer", skips_last_layer)
    e = Engine(config=config, family_factory=build_family)
    if not getattr(e.families["prefill"], "hierarchical", False):
        pytest.skip(f"this release's HiCache is not driven: {e.families['prefill'].declined.get('hicache') or 'no SGLang tree here'}")
    with pytest.raises(PoolfuzzFailure, match=r"StateLost: req \d+ .*component msa\.index_k layer 3 "):
        _demoted_then_continued(e)
