"""Speculative decoding's recurrent scratch: each verify writes the state after every draft token into the
request's scratch row, the commit keeps the accepted one's, and the rows are checked and poisoned like slots."""

import pytest
import torch

from poolfuzz.harness.contents import KIND_POISON, KIND_STATE, decode_row
from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure, signature_of
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools import CONFIGS, ConfigError
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.speculative import draft_step, scratch_name, state_component_of

NAME = "hybrid-spec"


def _served(config=CONFIGS[NAME], faults=()):
    e = Engine(config=config, faults=faults)
    rid = e.admit(5)
    e.check()
    e.prefill(rid, 5)
    e.check()
    return e, rid


def _scratch(e, name, layer, step):
    fam = e.families["prefill"]
    return next(c for c in fam.components() if c.name == scratch_name(name, step) and c.layer == layer)


def test_scratch_names_round_trip():
    assert draft_step("mamba.temporal@draft3") == 3 and draft_step("mamba.temporal") is None
    assert state_component_of("mamba.conv1@draft0") == "mamba.conv1"


def test_a_verify_fills_every_draft_step_and_the_commit_keeps_the_accepted_one():
    e, rid = _served()
    pos = e.requests[rid].kv.seqlen - 1
    assert e.decode_speculative(rid, draft=3, accepted=1)
    e.check()  # the scratch steps and the state slot are compared with their checksums here
    kv = e.requests[rid].kv
    layer = CONFIGS[NAME].mamba_layer_ids[0]
    for t in range(4):
        tag = decode_row(_scratch(e, "mamba.temporal", layer, t).tensor[kv.req_pool_idx])
        assert (tag.kind, tag.rid, tag.position) == (KIND_STATE, rid, pos + t + 1)
    state = next(c for c in e.families["prefill"].components() if c.name == "mamba.temporal" and c.layer == layer)
    assert torch.equal(state.tensor[kv.mamba_pool_idx], _scratch(e, "mamba.temporal", layer, 1).tensor[kv.req_pool_idx])
    assert kv.kv_committed_len == pos + 2


def test_a_verify_checks_at_most_the_configured_tokens():
    e, rid = _served(CONFIGS[NAME].replace(name="two", spec_draft_tokens=2))
    e.decode_speculative(rid, draft=3, accepted=3)
    assert e.log[-1].args == {"rid": rid, "draft": 1, "accepted": 1}
    e.check()


def test_a_clobbered_scratch_step_is_reported_with_its_step():
    e, rid = _served()
    e.decode_speculative(rid, draft=3, accepted=3)
    kv = e.requests[rid].kv
    _scratch(e, "mamba.conv0", CONFIGS[NAME].mamba_layer_ids[1], 2).tensor[kv.req_pool_idx] = 0
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert "draft step 2 of its scratch row" in str(info.value)
    assert signature_of(info.value).startswith("StateLost:contents:spec-scratch")


def test_a_released_row_s_scratch_is_poisoned():
    e, rid = _served()
    e.decode_speculative(rid, draft=2, accepted=0)
    row = e.requests[rid].kv.req_pool_idx
    e.finish(rid)
    e.check()
    tag = decode_row(_scratch(e, "mamba.temporal", CONFIGS[NAME].mamba_layer_ids[0], 0).tensor[row])
    assert tag.kind == KIND_POISON and tag.rid == rid


def test_the_scratch_needs_recurrent_state_and_a_draft():
    with pytest.raises(ConfigError, match="spec_draft_tokens"):
        ModelConfig(name="x", architecture="llama", spec_draft_tokens=4)
    with pytest.raises(ConfigError, match="spec_draft_tokens"):
        CONFIGS[NAME].replace(name="y", spec_draft_tokens=1)


def test_a_commit_of_the_last_draft_keeps_rejected_tokens_in_the_state():
    e, rid = _served(faults=["spec-commit-last-draft"])
    e.decode_speculative(rid, draft=2, accepted=2)  # all accepted: the last draft is the right one
    e.check()
    e.decode_speculative(rid, draft=2, accepted=0)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert signature_of(info.value).startswith("StateLost:contents:mamba")


@pytest.mark.parametrize("fault", ["spec-commit-last-draft", "spec-commit-batch-position"])
def test_each_speculative_fault_is_found(fault):
    result = run_machine(CONFIGS[NAME], faults=[fault], max_examples=100, seed=0, shrink_limit=5)
    assert not result.passed and result.signature.startswith("StateLost:contents:mamba"), result.failure


@pytest.mark.parametrize("name", [NAME, f"{NAME}-ps4"])
def test_the_correct_scratch_passes(name):
    assert run_machine(CONFIGS[name], max_examples=40, seed=0).passed


def test_a_request_longer_than_the_context_is_refused_not_written_past_its_row():
    """hybrid-spec-long: a 32-token context beside a 48-token pool. A fork (or a chat's next turn) whose prefix and
    new tokens outgrow the context is refused, as a server refuses the prompt, and allocates nothing; one that fits
    is asked of the pools. (Before, the pools wrote 34 positions into a 32-position request row and crashed.)"""
    e, rid = _served(CONFIGS["hybrid-spec-long"])
    for _ in range(24):  # decode to 30 tokens: 29 committed
        assert e.decode([rid]) == [rid]
        e.check()
    free = {space: fl.available_size() for space, fl in e.families["prefill"].free_lists().items()}
    assert e.fork(rid, 6) is None
    assert e.log[-1].outcome.startswith("refused: ") and "longer than the 32-token context" in e.log[-1].outcome
    assert {space: fl.available_size() for space, fl in e.families["prefill"].free_lists().items()} == free
    e.check()
    e.fork(rid, 1)  # 30 tokens: asked of the pools (this full pool has no room for it)
    assert "longer than" not in e.log[-1].outcome
    e.check()
