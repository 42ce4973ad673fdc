"""A request's protected prefix (``ReqKv.cache_protected_len``: a radix hit, or what a prefix tree took at a
checkpoint) is the tree's, not the request's: it is counted once, as the tree's, and must stay held by it."""

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import InvariantViolation, signature_of
from poolfuzz.pools.capabilities import capabilities_of
from poolfuzz.pools.config import CONFIGS


def _with_tree_holding(engine, units_of):
    """Let the prefill node's family answer ``cached_units`` as a prefix tree would: ``units_of(engine)``."""
    fam = engine.families["prefill"]
    fam.cached_units = lambda: {"full": units_of(engine)}
    engine.caps["prefill"] = capabilities_of(fam)  # declared after the build: read again, as a build reads it
    return fam


def _prefilled(engine, prompt_len=6):
    rid = engine.admit(prompt_len)
    engine.prefill(rid, prompt_len)
    engine.check()
    return rid


@pytest.mark.parametrize("name", ["dense", "dense-ps4"])
def test_a_prefix_the_tree_holds_is_counted_once(name):
    engine = Engine(config=CONFIGS[name])
    rid = _prefilled(engine)
    kv = engine.requests[rid].kv
    ps = CONFIGS[name].page_size
    kv.cache_protected_len = 4  # the tree took the first page(s) at a checkpoint
    fam = engine.families["prefill"]
    prefix = fam.req_pool.read(kv.req_pool_idx, 0, 4).tolist()
    _with_tree_holding(engine, lambda e: sorted({s // ps for s in prefix}))
    engine.sweep()  # held by the tree only: not "held by two owners"


def test_a_protected_prefix_the_tree_no_longer_holds_fails():
    engine = Engine(config=CONFIGS["dense"])
    first, second = _prefilled(engine), _prefilled(engine)
    kv = engine.requests[second].kv
    kv.cache_protected_len = 3
    fam = engine.families["prefill"]
    kept = fam.req_pool.read(kv.req_pool_idx, 0, 2).tolist()  # the tree lost the node holding position 2
    _with_tree_holding(engine, lambda e: kept)
    lost = int(fam.req_pool.read(kv.req_pool_idx, 2, 3)[0])
    with pytest.raises(InvariantViolation, match=rf"req {second}: position 2 of its protected prefix .* full slot {lost}, "
                                                 "which the tree no longer holds") as info:
        engine.sweep()
    assert signature_of(info.value) == "InvariantViolation:consumer-map:full"
    assert info.value.divergence.slot_after == lost and first != second
