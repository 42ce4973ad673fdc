"""An idle node's cache flush in the middle of a run (``flush_cache``, as after an RL weight update)."""

import pytest

from poolfuzz.harness.engine import FLUSH_AFTER
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.harness.program import CannotRun, new_engine, precondition
from poolfuzz.harness.records import StepRecord
from poolfuzz.pools import CONFIGS
from poolfuzz.pools.family import PoolFamily

# A request served and forked (the prefix tree checkpoints its recurrent state), the fork aborted and the
# source finished: the tree still holds the checkpoint's mamba slot when the node flushes.
CHECKPOINTED = [("admit", {"prompt_len": 4}), ("prefill", {"rid": 1, "chunk": 4}), ("fork", {"src_rid": 1, "extra": 2}),
                ("abort", {"rid": 2}), ("finish", {"rid": 1})]


def _run(config, program, faults=()):
    engine = new_engine(config=config, faults=faults)
    for op, args in program:
        getattr(engine, op)(**args)
        engine.check()
    return engine


def test_a_flush_drops_the_tree_and_the_node_serves_on():
    e = _run(CONFIGS["hybrid-linear"], CHECKPOINTED)
    fam = e.families["prefill"]
    assert fam.prefix_tree.held_slots(), "the program should leave a checkpoint in the tree"
    poisoned = []
    listener = fam.req_pool.mamba_allocator.on_free
    fam.req_pool.mamba_allocator.on_free = lambda space, slots: (poisoned.extend(slots.tolist()), listener(space, slots))
    held = fam.prefix_tree.held_slots()
    e.flush("prefill")
    e.check()
    assert not fam.prefix_tree.nodes and sorted(poisoned) == sorted(held)  # dropped slots are free, and poisoned
    for space, alloc in fam.free_lists().items():
        assert alloc.available_size() == e.refs["prefill"].capacity[space], space
    assert e.log[-1].op == "flush" and e.flushable() == []  # nothing served since
    rid = e.admit(6)  # the reset pools serve a retraction round trip and a fork
    for op, args in [("prefill", {"rid": rid, "chunk": 6}), ("decode", {"rids": [rid]}), ("retract", {"rid": rid}),
                     ("resume", {"node": "prefill"}), ("fork", {"src_rid": rid, "extra": 1})]:
        getattr(e, op)(**args)
        e.check()
    e.sweep()
    e.drain()


def test_a_reset_that_keeps_the_state_slots_is_caught_at_the_flush():
    e = _run(CONFIGS["hybrid-linear"], CHECKPOINTED, faults=["flush-keeps-state-slots"])
    with pytest.raises(PoolfuzzFailure) as info:
        e.flush("prefill")
    d = info.value.divergence
    assert (d.check, d.space, d.op, d.node) == ("flush-leak", "mamba", "flush", "prefill"), info.value
    assert "after the flush reset its pools, mamba has" in str(info.value)


def test_only_an_idle_node_that_served_a_batch_of_requests_flushes():
    e = new_engine(config=CONFIGS["dense"])
    assert e.flushable() == []  # nothing served yet
    for served in range(1, FLUSH_AFTER + 1):
        rid = e.admit(3)
        e.prefill(rid, 3)
        if served == 1:
            with pytest.raises(CannotRun, match=f"req {rid} is live there"):
                precondition(e, StepRecord(op="flush", args={"node": "prefill"}, outcome=""))
        assert e.flushable() == []
        e.finish(rid)
    assert e.flushable() == ["prefill"]  # a weight update after a batch of requests
    e.flush("prefill")
    assert e.flushable() == []


def test_a_family_without_flush_cache_never_flushes(monkeypatch):
    monkeypatch.setattr(PoolFamily, "flush_cache", None)
    e = _run(CONFIGS["dense"], [("admit", {"prompt_len": 2}), ("prefill", {"rid": 1, "chunk": 2}),
                                ("finish", {"rid": 1})])
    assert e.flushable() == []
    with pytest.raises(CannotRun, match="no flush_cache"):
        precondition(e, StepRecord(op="flush", args={"node": "prefill"}, outcome=""))
