"""All-SWA models (every layer sliding-window): the swa-only config, its window-only state type and its fault."""

import pytest

from poolfuzz.harness.program import new_engine
from poolfuzz.harness.state_types import SlidingWindowKV, WindowOnlyKV, state_types_for
from poolfuzz.pools import CONFIGS
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError, DoubleFree
from poolfuzz.pools.family import build_family
from poolfuzz.pools.faults import applicable_configs
from poolfuzz.pools.shortest_known import shortest_known

# A request longer than the window (6), decoded so the window slides, then finished: its row still holds
# the slots of the evicted positions, which window eviction already freed.
PAST_THE_WINDOW = [("admit", {"prompt_len": 9}), ("prefill", {"rid": 1, "chunk": 9}), ("decode", {"rids": [1]}),
                   ("finish", {"rid": 1})]


def _run(config, faults, program, *, teardown=True):
    engine = new_engine(config=config, faults=faults)
    for op, args in program:
        getattr(engine, op)(**args)
        engine.check()
    if teardown:
        engine.sweep()
        engine.drain()
    return engine


def test_swa_without_full_is_window_only_kv():
    mixed = state_types_for(["rows", "full", "swa"])
    assert type(mixed["swa"]) is SlidingWindowKV and not mixed["swa"].row_addressed and mixed["full"].row_addressed
    alone = state_types_for(["rows", "swa"])
    assert type(alone["swa"]) is WindowOnlyKV and alone["swa"].row_addressed


def test_the_swa_only_family_has_one_token_space_whose_slots_are_the_rows():
    config = CONFIGS["swa-only"]
    assert not config.has_full and config.has_swa and "full" not in config.device_capacity()
    fam = build_family(config)
    assert set(fam.free_lists()) == {"rows", "swa"}
    assert {c.space for c in fam.components()} == {"swa"}
    assert fam.allocator.window_only and fam.allocator.translate([3, 5]).tolist() == [3, 5]
    assert fam.backup_mode == "cpu_tensor"  # SGLang's host-pool retraction rejects all-SWA models


def test_held_slots_start_at_the_window_frontier():
    """After the window slid, the request holds only [swa_evicted_seqlen, allocated): the stale row entries
    before it are free slots, and the every-step checks (free == total - held) pass on that count."""
    engine = _run(CONFIGS["swa-only"], [], PAST_THE_WINDOW[:3], teardown=False)
    fam = engine.families["prefill"]
    req = engine.requests[1]
    assert req.kv.swa_evicted_seqlen > 0
    tokens = engine.lookup.tokens(fam, req.kv.req_pool_idx, 0, req.kv.kv_allocated_len)
    held = engine.state_types["swa"].held_units(engine.lookup, fam, req.kv, tokens)
    assert len(held) == req.kv.kv_allocated_len - req.kv.swa_evicted_seqlen
    assert fam.allocator.available_size() == CONFIGS["swa-only"].swa_tokens - len(held)


@pytest.mark.parametrize("changes, words", [
    (dict(page_size=4), "page_size 1"), (dict(full_tokens=64), "full_tokens = 0"),
    (dict(mamba_layers=1, mamba_slots=2), "all-SWA model"),
    (dict(swa_layers=0, sliding_window=0, swa_tokens=0), "full_layers must be >= 1")])
def test_impossible_all_swa_configs_are_refused(changes, words):
    with pytest.raises(ConfigError, match=words):
        CONFIGS["swa-only"].replace(**changes)


def test_the_fault_double_frees_the_evicted_window():
    fault = "release-frees-evicted-window"
    assert applicable_configs(fault) == ["swa-only"]
    served = PAST_THE_WINDOW[:3]  # the release at teardown is the fourth step's
    assert shortest_known(fault, CONFIGS["swa-only"]) == len(served)
    for program in (served, PAST_THE_WINDOW):
        with pytest.raises(DoubleFree):
            _run(CONFIGS["swa-only"], [fault], program)
        _run(CONFIGS["swa-only"], [], program)  # and without it, the same program passes


def test_faults_on_the_mixed_swa_allocator_do_not_apply_to_an_all_swa_model():
    for fault in ("free-swa-keeps-mapping", "allocator-double-free-undetected", "free-group-drops-swa",
                  "swa-reload-unmapped-rows", "host-load-stops-at-pool-layer-count"):
        assert "swa-only" not in applicable_configs(fault), fault


def test_a_request_at_its_context_length_is_finished_not_grown():
    """Only the window lets one request reach its row's end: decodes past it are skipped (the scheduler
    finishes a request by length), and a speculative step drafts no further than it."""
    config = CONFIGS["swa-only"].replace(name="swa-only-short", max_context=10)
    program = [("admit", {"prompt_len": 8}), ("prefill", {"rid": 1, "chunk": 8})]
    program += [("decode_speculative", {"rid": 1, "draft": 4, "accepted": 4})] + [("decode", {"rids": [1]})] * 3
    engine = _run(config, [], program, teardown=False)
    kv = engine.requests[1].kv
    assert kv.kv_allocated_len == kv.kv_committed_len == 10  # its row, full; the token sampled last has no KV


def test_every_layer_sliding_window_is_the_default_layout():
    config = ModelConfig(name="all-swa", architecture="gpt-oss", full_layers=0, swa_layers=3, sliding_window=4,
                         full_tokens=0, swa_tokens=24)
    assert config.layers == "SSS" and config.full_layer_ids == ()
