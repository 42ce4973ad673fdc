"""The next_turn operation: only for families that declare it, and replay holds it to its precondition."""

from __future__ import annotations

import pytest
from poolfuzz.harness.engine import Engine
from poolfuzz.harness.machine import machine_for
from poolfuzz.harness.program import CannotRun, check_steps, precondition
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family


def test_the_rule_exists_only_where_the_family_factory_declares_it():
    def continuing(config, **kw):
        return build_family(config, **kw)

    continuing.supports_next_turn = True
    assert not hasattr(machine_for("dense"), "next_turn")  # the built-in family's draws are unchanged
    assert callable(machine_for("dense", family_factory=continuing).next_turn)


def test_the_built_in_family_keeps_no_finished_request():
    engine = Engine(config=CONFIGS["dense"])
    rid = engine.admit(5)
    engine.prefill(rid, 5)
    engine.finish(rid)
    engine.check()
    assert engine.finished == {}


@pytest.mark.parametrize("finished", [False, True])
def test_replay_runs_a_next_turn_only_of_a_finished_request(finished):
    engine = Engine(config=CONFIGS["dense"])
    rid = engine.admit(5)
    engine.prefill(rid, 5)
    step = check_steps([{"op": "next_turn", "args": {"src_rid": rid, "extra": 2}}])[0]
    if finished:  # as a continuing family records it
        engine.finished[rid] = object()
        precondition(engine, step)
    else:
        with pytest.raises(CannotRun, match=f"req {rid} has not finished here"):
            precondition(engine, step)
