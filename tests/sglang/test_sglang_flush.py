"""An idle node runs SGLang's ``Scheduler.flush_cache`` (pools reset in place) at drain; every pool must be whole."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _engine(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    e = Engine(config=CONFIGS[name], family_factory=build_family)
    if type(e.families["prefill"]).flush_prefix_cache.__qualname__ != "SGLangFamily.flush_prefix_cache":
        pytest.skip(f"{name} runs with SGLang's prefix tree here, which flushes by evicting")
    return e


def _busy(e):
    a = e.admit(9)
    e.prefill(a, 9)
    b = e.admit(5)
    e.prefill(b, 5)
    e.decode([a, b])
    e.retract(b)
    e.check()
    return a, b


# chunk-cache configs on 0.5.23 (its trees serve the SWA configs and the mamba ones at page size 1)
@pytest.mark.parametrize("name", ["hybrid-linear-ps4", "swa-ssm-ps4", "hybrid-extra-buffer"])
def test_a_flushed_idle_node_has_every_pool_whole(api, monkeypatch, name):
    e = _engine(api, name)
    cleared = []
    pool_cls = type(e.families["prefill"].sg_req_pool)
    real = pool_cls.clear
    monkeypatch.setattr(pool_cls, "clear", lambda self: (cleared.append(type(self).__name__), real(self))[1])
    _busy(e)
    e.drain()
    assert len(cleared) == 2  # both nodes were idle and flushed
    for fam in e.families.values():
        if fam.has_recurrent_state():
            assert int(fam.sg_req_pool.req_index_to_mamba_index_mapping.abs().sum()) == 0


def test_a_flush_that_loses_a_row_is_caught(api, monkeypatch):
    e = _engine(api, "hybrid-linear-ps4")
    pool_cls = type(e.families["prefill"].sg_req_pool)
    real = pool_cls.clear

    def lossy(self):
        real(self)
        self.free_slots = self.free_slots[:-1]

    monkeypatch.setattr(pool_cls, "clear", lossy)
    _busy(e)
    with pytest.raises(PoolfuzzFailure) as info:
        e.drain()
    assert info.value.divergence.space == "rows", info.value


def _tree_engine(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    e = Engine(config=CONFIGS[name], family_factory=build_family)
    if getattr(e.families["prefill"], "tree", None) is None:
        pytest.skip(f"{name} runs without SGLang's prefix tree on {api.version}")
    return e


def _served_through_the_tree(e):
    a = e.admit(9)
    for op, args in [("prefill", (a, 9)), ("decode", ([a],))]:
        getattr(e, op)(*args)
        e.check()
    b = e.fork(a, 3)
    e.check()
    e.prefill(b, 12)
    e.finish(b)
    e.finish(a)
    e.check()
    return a


@pytest.mark.parametrize("name", ["dense", "hybrid-linear", "swa-ssm", "swa-only"])
def test_a_mid_run_flush_resets_the_tree_and_the_node_serves_on(api, name):
    """SGLang's own ``flush_cache`` sequence (tree reset, then the pools in place) on a node whose tree holds
    the served requests' prefixes and checkpoints; a next turn then finds nothing cached, and the reset
    pools serve a retraction round trip."""
    e = _tree_engine(api, name)
    fam = e.families["prefill"]
    a = _served_through_the_tree(e)
    assert fam.tree_sizes()[0] > 0, "the tree should hold the served prefixes"
    e.flush("prefill")
    e.check()
    assert fam.tree_sizes()[0] == 0 and not any(fam.cached_units().values())
    if a in e.finished:  # configs whose tree continues a chat: the flushed prefix is not found
        c = e.next_turn(a, 2)
        assert "hit 0" in e.log[-1].outcome
        e.prefill(c, 20)
        e.check()
    d = e.admit(7)
    for op, args in [("prefill", (d, 7)), ("decode", ([d],)), ("retract", (d,)), ("resume", ("prefill",))]:
        getattr(e, op)(*args)
        e.check()
    e.sweep()
    e.drain()


def test_a_flush_that_keeps_the_tree_is_caught(api, monkeypatch):
    """Pools reset under a tree that still holds their slots: the slots are free and the tree's at once."""
    e = _tree_engine(api, "dense")
    monkeypatch.setattr(type(e.families["prefill"].tree), "reset", lambda self: None)
    _served_through_the_tree(e)
    with pytest.raises(PoolfuzzFailure) as info:
        e.flush("prefill")
        e.check()
    assert info.value.divergence.space == "full", info.value
