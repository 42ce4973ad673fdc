"""Tree verify (EAGLE topk 2, NGRAM): the accepted path's KV is written on its tree nodes and moved to the front."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.harness.forward import accepted_node, tree_depths
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family
from poolfuzz.pools.kv import MHATokenToKVPool, SWAKVPool


def _served(name: str) -> tuple[Engine, int]:
    e = Engine(config=CONFIGS[name], family_factory=build_family)
    rid = e.admit(9)
    e.prefill(rid, 9)
    e.check()
    return e, rid


def test_the_window_is_breadth_first_with_the_path_on_the_second_branch():
    assert tree_depths(7, "cpu").tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert [accepted_node(d) for d in (1, 2, 3)] == [2, 4, 6]  # never the chain's own slot


@pytest.mark.parametrize("name", ["dense", "swa-ps4", "hybrid-linear", "mla-ps4", "dsa-ps64", "fp8-scaled"])
def test_a_tree_step_commits_the_accepted_path(name):
    e, rid = _served(name)
    assert e.decode_speculative(rid, 6, 3, tree=True)
    e.check()
    kv = e.requests[rid].kv
    assert kv.kv_committed_len == 9 + 1 + 3  # at most draft // 2 accepted: one node a level is on the path
    e.decode([rid])
    e.check()


def test_accepted_drafts_are_capped_at_the_tree_depth():
    e, rid = _served("dense")
    assert e.decode_speculative(rid, 2, 2, tree=True)
    assert e.log[-1].args == {"rid": rid, "draft": 2, "accepted": 1, "tree": True}


@pytest.mark.parametrize("name", ["dense", "swa"])
def test_a_move_that_leaves_the_rows_where_the_tree_put_them_is_caught(name, monkeypatch):
    """Without the move the window's front holds the first branch's drafts: position p reads depth p // 2's."""
    monkeypatch.setattr(MHATokenToKVPool, "move_kv_cache", lambda self, tgt, src: None)
    e, rid = _served(name)
    e.decode_speculative(rid, 6, 3, tree=True)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert type(info.value).__name__ == "StateLost" and info.value.divergence.rid == rid, info.value


def test_an_swa_move_that_forgets_the_window_peers_is_caught(monkeypatch):
    """SWAKVPool.move_kv_cache moves the SWA rows through full_to_swa too; a move of the full rows alone leaves
    the sliding-window layers reading the first branch's drafts."""
    monkeypatch.setattr(SWAKVPool, "move_kv_cache", lambda self, tgt, src: self.full_kv_pool.move_kv_cache(tgt, src))
    e, rid = _served("swa")
    e.decode_speculative(rid, 6, 3, tree=True)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert info.value.divergence.space == "swa", info.value


def test_the_machine_draws_tree_steps(monkeypatch):
    """The state machine issues tree verifies where the family moves rows: a broken move fails a short run."""
    monkeypatch.setattr(MHATokenToKVPool, "move_kv_cache", lambda self, tgt, src: None)
    result = run_machine(CONFIGS["dense"], max_examples=100, seed=0, shrink_limit=0)
    assert not result.passed and "StateLost" in result.failure, result.failure


def test_no_tree_steps_where_speculative_scratch_is_kept():
    from poolfuzz.harness.forward import tree_verifies

    class _Machine:
        engine = Engine(config=CONFIGS["hybrid-spec"], family_factory=build_family)

    assert not tree_verifies(_Machine.engine)


def test_a_recorded_tree_step_cannot_run_on_a_family_that_issues_no_tree_verifies():
    """An artifact with a tree verify, replayed where the family moves no accepted rows (or keeps a
    speculative scratch), is refused by the step's precondition, not run into a traceback."""
    from poolfuzz.harness.program import CannotRun, precondition
    from poolfuzz.harness.records import StepRecord

    tree_step = StepRecord(op="decode_speculative", args={"rid": 1, "draft": 2, "accepted": 1, "tree": True},
                           outcome="")
    e, rid = _served("hybrid-spec")  # a speculative scratch per step: no tree verifies
    assert rid == 1
    with pytest.raises(CannotRun, match="supports_tree_drafts"):
        precondition(e, tree_step)
    precondition(e, StepRecord(op="decode_speculative", args={"rid": 1, "draft": 2, "accepted": 1}, outcome=""))
    served, _ = _served("dense")
    precondition(served, tree_step)  # the built-in MHA pool moves rows: the step runs


@pytest.mark.parametrize("name", ["dense", "swa-ps4"])
def test_a_move_from_the_branch_the_verify_rejected_is_caught(name, monkeypatch):
    """The rejected branch's nodes hold drafts for the same depths: a move that takes them (an accept index
    off by one node) lands KV of the right positions but of drafts the verify rejected, and says so."""
    e, rid = _served(name)
    protocol_cls = type(e.families["prefill"].protocol)
    real = protocol_cls.move_accepted

    def from_the_other_branch(self, kv, fam, *, tgt, src):
        row = fam.req_pool.read(kv.req_pool_idx, 0, kv.kv_allocated_len).tolist()
        root = row.index(int(tgt[0])) - 1  # the window's node 0; depth d's two drafts are nodes 2d - 1, 2d
        wrong = torch.tensor([row[root + 2 * d - 1] for d in range(1, len(tgt) + 1)], dtype=src.dtype)
        return real(self, kv, fam, tgt=tgt, src=wrong)

    monkeypatch.setattr(protocol_cls, "move_accepted", from_the_other_branch)
    e.decode_speculative(rid, 6, 3, tree=True)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert type(info.value).__name__ == "StateLost" and info.value.divergence.rid == rid, info.value
    assert "a draft on the branch the verify rejected" in str(info.value), info.value
