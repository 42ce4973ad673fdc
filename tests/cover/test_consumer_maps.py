"""What the kernels read to find a request's state is checked, not only what the harness reads back: the
row-to-mamba-slot mapping and full_to_swa of every held, unevicted token."""

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import InvariantViolation, signature_of
from poolfuzz.pools.config import CONFIGS


def _prefilled(engine, prompt_len=5):
    rid = engine.admit(prompt_len)
    engine.check()
    engine.prefill(rid, prompt_len)
    engine.check()
    return rid


@pytest.mark.parametrize("name", ["hybrid-linear", "swa-ssm-ps4"])
def test_a_pool_that_never_writes_the_row_to_mamba_mapping_fails_at_admission(name):
    engine = Engine(config=CONFIGS[name], faults=("mamba-mapping-not-written",))
    rid = engine.admit(3)
    with pytest.raises(InvariantViolation, match=r"req 1: row \d+'s mamba slot as the kernels read it "
                                                 r"\(get_mamba_indices\) is 0, but the request holds slot 1") as info:
        engine.check()
    assert info.value.divergence.space == "mamba" and info.value.divergence.slot_after == 1
    assert signature_of(info.value) == "InvariantViolation:consumer-map:mamba"
    assert rid == 1


def test_a_mapping_that_points_at_another_requests_slot_fails():
    engine = Engine(config=CONFIGS["hybrid-linear"])
    first, second = _prefilled(engine), _prefilled(engine)
    fam = engine.families["prefill"]
    kv = engine.requests[second].kv
    fam.req_pool.req_to_mamba[kv.req_pool_idx] = engine.requests[first].kv.mamba_pool_idx
    with pytest.raises(InvariantViolation, match=rf"req {second}: .* is {engine.requests[first].kv.mamba_pool_idx}, "
                                                 rf"but the request holds slot {kv.mamba_pool_idx}"):
        engine.sweep()


@pytest.mark.parametrize("name", ["swa", "swa-ps4"])
def test_a_held_token_ahead_of_the_window_without_an_swa_slot_fails(name):
    """Slots allocated ahead of the committed length are outside what the contents check reads; the forward
    still writes their SWA KV through full_to_swa."""
    engine = Engine(config=CONFIGS[name])
    rid = _prefilled(engine, prompt_len=3)
    kv = engine.requests[rid].kv
    fam = engine.families["prefill"]
    last = int(fam.req_pool.read(kv.req_pool_idx, kv.kv_allocated_len - 1, kv.kv_allocated_len)[0])
    fam.allocator.full_to_swa[last] = 0
    with pytest.raises(InvariantViolation, match=rf"req {rid}: position {kv.kv_allocated_len - 1} \(full slot {last}\) "
                                                 "is held and not evicted .* full_to_swa maps it to no SWA slot"):
        engine.sweep()


def test_correct_pools_keep_every_consumer_map():
    for name in ("hybrid-linear", "swa-ssm", "swa-ps4"):
        engine = Engine(config=CONFIGS[name])
        rid = _prefilled(engine)
        engine.retract(rid)
        engine.check()
        engine.sweep()
