"""An all-SWA model (swa-only) on SGLang's own PureSWATokenToKVPoolAllocator and, where the release's tree is
driven, its PureSWARadixCache (the only way 0.5.23 builds a plain RadixCache)."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError

CONFIG = CONFIGS["swa-only"]


@pytest.fixture
def pure_swa_api(api):
    if api.PureSWATokenToKVPoolAllocator is None:
        pytest.skip(f"SGLang {api.version} has no PureSWATokenToKVPoolAllocator (see the decline test)")
    return api


def test_a_release_without_the_pure_swa_allocator_declines_the_config(api):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.family import unsupported_reason

    if api.PureSWATokenToKVPoolAllocator is not None:
        assert unsupported_reason(CONFIG) is None
        return
    assert "PureSWATokenToKVPoolAllocator" in unsupported_reason(CONFIG)
    with pytest.raises(ConfigError, match="all-SWA"):
        build_family(CONFIG)


def test_the_pools_are_sglangs_pure_swa_pools(pure_swa_api):
    from poolfuzz.adapters.sglang import build_family

    fam = build_family(CONFIG)
    assert type(fam.sg_allocator) is pure_swa_api.PureSWATokenToKVPoolAllocator
    assert set(fam.free_lists()) == {"rows", "swa"}
    assert {c.space for c in fam.components()} == {"swa"}
    assert fam.allocator.translate([4, 7]).tolist() == [4, 7]  # SGLang's identity full_to_swa


def _engine():
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine

    return Engine(config=CONFIG, family_factory=build_family)


def test_a_fork_hits_the_pure_swa_radix_cache_and_finish_caches_the_prefill(pure_swa_api):
    e = _engine()
    fam = e.families["prefill"]
    tree = getattr(fam, "tree", None)
    if tree is None:
        pytest.skip(f"SGLang {pure_swa_api.version}'s tree is not driven here")
    assert type(tree).__name__ == "PureSWARadixCache"
    src = e.admit(9)
    e.check()
    e.prefill(src, 9)
    e.check()
    assert fam.tree_sizes()[0] > 0  # the checkpoint inserted the prefill
    e.decode([src])
    e.check()
    dst = e.fork(src, 2)
    e.check()
    assert e.requests[dst].kv.cache_protected_len > 0  # a radix hit, locked, held by the tree
    e.finish(src)
    e.check()
    e.finish(dst)
    e.check()
    fam.flush_prefix_cache()
    e.sweep()
    e.drain()
    assert fam.tree_sizes() == (0, 0)


def test_swa_only_fuzzes_clean(pure_swa_api, fuzz):
    outcome = fuzz(CONFIG, examples=40)
    assert outcome.failure is None, outcome.failure
