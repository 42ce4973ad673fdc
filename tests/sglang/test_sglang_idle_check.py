"""SGLang's own idle memory check (``Scheduler.on_idle``) asked on an idle node, beside poolfuzz's checks."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _tree_engine(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason
    from poolfuzz.adapters.sglang.tree import idle_check

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    e = Engine(config=CONFIGS[name], family_factory=build_family)
    fam = e.families["prefill"]
    if getattr(fam, "tree", None) is None:
        pytest.skip(f"{name} runs without SGLang's prefix tree on {api.version}")
    if idle_check.invariant_checker_for(fam) is None:
        pytest.skip(f"SGLang {api.version} has no SchedulerInvariantChecker")
    return e


def _served(e):
    a = e.admit(9)
    e.prefill(a, 9)
    e.decode([a])
    b = e.fork(a, 3)
    e.prefill(b, 12)
    e.finish(b)
    e.finish(a)
    e.check()


@pytest.mark.parametrize("name", ["dense-ps4", "hybrid-linear", "swa-ssm", "swa-only"])
def test_sglangs_idle_check_agrees_that_a_served_node_is_whole(api, name):
    e = _tree_engine(api, name)
    _served(e)
    assert e.families["prefill"].idle_problem() is None
    e.flush("prefill")  # asks it first
    e.sweep()
    e.drain()  # and at the drain


def test_a_page_nobody_holds_is_reported_by_sglangs_own_check(api):
    e = _tree_engine(api, "dense-ps4")
    _served(e)
    fam = e.families["prefill"]
    fam.sg_allocator.alloc(4)  # taken by no request and no tree node
    problem = fam.idle_problem()
    assert problem is not None and "[full]" in problem, problem
    with pytest.raises(PoolfuzzFailure) as info:
        e.checker.check_engine_idle("prefill")
    assert info.value.divergence.check == "engine-idle-check"
    assert "the engine's own idle memory check reports: [full]" in str(info.value)
