"""Mamba extra-buffer mode: a request's ping-pong track slots are held, written in turn, checked and freed."""

import pytest

from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools import CONFIGS, ConfigError, PoolExhausted, build_family
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.request import ReqKv

NAME = "hybrid-extra-buffer"


def test_a_request_holds_its_state_slot_and_two_track_slots():
    family = build_family(CONFIGS[NAME], device="cpu")
    mamba = family.req_pool.mamba_allocator
    total = mamba.available_size()
    req = ReqKv(rid=1, seqlen=4)
    family.protocol.admit(req, family)
    assert len(req.mamba_track) == 2 and req.mamba_pool_idx not in req.mamba_track
    assert mamba.available_size() == total - 3
    family.protocol.release_kv(req, family)
    assert mamba.available_size() == total and req.mamba_track == ()


def test_the_track_slots_are_written_in_turn():
    family = build_family(CONFIGS[NAME], device="cpu")
    req = ReqKv(rid=1, seqlen=4)
    family.protocol.admit(req, family)
    turns = [family.protocol.next_track_slot(req, family) for _ in range(4)]
    assert turns == [req.mamba_track[0], req.mamba_track[1]] * 2


def test_admission_counts_the_track_slots_with_the_state_slot():
    """Two free slots cannot admit a request that needs three: nothing is taken."""
    family = build_family(CONFIGS[NAME].replace(name="tight", mamba_slots=5), device="cpu")
    first = ReqKv(rid=1, seqlen=2)
    family.protocol.admit(first, family)
    rows = family.req_pool.rows.available_size()
    with pytest.raises(PoolExhausted) as info:
        family.protocol.admit(ReqKv(rid=2, seqlen=2), family)
    assert info.value.space == "mamba" and info.value.requested == 3
    assert family.req_pool.mamba_allocator.available_size() == 2 and family.req_pool.rows.available_size() == rows


def test_the_mode_needs_recurrent_state():
    with pytest.raises(ConfigError, match="mamba_track_slots"):
        ModelConfig(name="x", architecture="llama", mamba_track_slots=2)


@pytest.mark.parametrize(("fault", "signature"), [
    ("track-slots-not-freed", "ReferenceMismatch:free-count:mamba"),
    ("ping-pong-stuck", "StateLost:contents:mamba@decode"),
])
def test_each_mode_fault_is_found(fault, signature):
    result = run_machine(CONFIGS[NAME], faults=[fault], max_examples=100, seed=0, shrink_limit=5)
    assert not result.passed and result.signature.startswith(signature.split("@")[0]), result.failure


def test_the_correct_mode_passes():
    assert run_machine(CONFIGS[NAME], max_examples=40, seed=0).passed
