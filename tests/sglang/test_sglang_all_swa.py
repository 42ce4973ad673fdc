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
    from poolfuzz.adapters.sglang.lifecycle.family import unsupported_reason

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


def test_swa_only_fuzzes_clean_without_decode_eviction(pure_swa_api, fuzz, monkeypatch):
    """No false alarm off the known defect's path: at SGLang's own interval, 128 tokens, no decode here
    evicts its window (the adapter's default, one window, reaches sglang#31486 on 0.5.23: the next test)."""
    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "128")
    outcome = fuzz(CONFIG, examples=40)
    assert outcome.failure is None, outcome.failure


def _tree_holds_free_slots(fam) -> list[int]:
    """SGLang's own objects, read directly: the slots PureSWARadixCache holds that its allocator lists as free."""
    from poolfuzz.adapters.sglang.pools.views import token_free_pages

    if not fam.tree_sizes()[0]:
        return []
    free = set(token_free_pages(fam.sg_allocator.swa_attn_allocator))
    return sorted(int(v) for v in fam.tree.all_values_flatten().tolist() if int(v) in free)


def test_a_tree_that_recaches_window_evicted_slots_is_caught(pure_swa_api, monkeypatch):
    """With eviction every token (``SGLANG_SWA_EVICTION_INTERVAL=1``; the adapter's default is one window),
    a request transferred to the decode node holds no tree prefix, so decode eviction frees its first
    positions; its finish checkpoints ``[0, owned)`` into PureSWARadixCache, whose key is capped only by
    ``swa_evict_floor`` (0 unless the model is prefill-aware): the tree then holds slots the allocator lists
    as free (sglang#31486 describes it, closed). Whatever the release does, the harness's verdict is SGLang's
    own state: it reports a failure exactly when the tree holds a free slot."""
    from poolfuzz.harness.failures import PoolfuzzFailure

    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "1")
    e = _engine()
    fam = e.families["decode"]
    if getattr(fam, "tree", None) is None:
        pytest.skip(f"SGLang {pure_swa_api.version}'s tree is not driven here")
    rid = e.admit(5)
    e.prefill(rid, 5)
    e.transfer(rid)
    e.decode_speculative(rid, 1, 1)
    e.decode([rid])
    e.check()
    assert e.requests[rid].kv.swa_evicted_seqlen > 0  # the window slid on the decode node
    try:
        e.finish(rid)
        e.check()
        caught = None
    except PoolfuzzFailure as exc:
        caught = exc
    stale = _tree_holds_free_slots(fam)
    if not stale and caught is None:
        # a release whose tree keeps window-evicted slots out (sglang#31486 merged): nothing to catch here
        pytest.skip(f"SGLang {pure_swa_api.version}'s tree held no freed slot after the finish")
    assert (caught is not None) == bool(stale), (caught, stale)
    if caught is not None:
        assert "swa" in str(caught) and type(caught).__name__ in ("InvariantViolation", "ReferenceMismatch"), caught
