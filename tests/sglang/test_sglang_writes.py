"""The forward's KV rows go through SGLang's own write door (``set_kv_buffer``), which files them by layer,
sub-pool and slot; the checksums then say whether it filed them where the request's slots are."""

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
    return Engine(config=CONFIGS[name], family_factory=build_family)


def _serve(e):
    rid = e.admit(7)
    e.prefill(rid, 7)
    e.decode([rid])
    return rid


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "swa", "hybrid-linear", "mla"])
def test_every_attention_layer_is_written_through_the_pool(api, monkeypatch, name):
    """One ``set_kv_buffer`` call per attention layer and forward, on the pool the backend holds."""
    e = _engine(api, name)
    pool = e.families["prefill"].sg_kv_pool
    calls = []
    real = type(pool).set_kv_buffer
    monkeypatch.setattr(type(pool), "set_kv_buffer",
                        lambda self, layer, *a, **k: (calls.append(layer.layer_id), real(self, layer, *a, **k))[1])
    _serve(e)
    e.check()
    c = CONFIGS[name]
    assert sorted(set(calls)) == sorted(c.full_layer_ids + c.swa_layer_ids)
    assert len(calls) == 2 * (c.full_layers + c.swa_layers)  # the prefill and the decode


def test_sliding_window_rows_filed_under_their_full_slots_are_caught(api, monkeypatch):
    """If the SWA locations the backend hands the pool came in another order than the tokens (here reversed),
    each SWA row would land in another position's slot: the window's checksums see it."""
    e = _engine(api, "swa")
    pool = e.families["prefill"].sg_kv_pool
    if not hasattr(type(pool), "translate_loc_from_full_to_swa"):
        pytest.skip("this release translates inside set_kv_buffer")
    real = type(pool).translate_loc_from_full_to_swa
    monkeypatch.setattr(type(pool), "translate_loc_from_full_to_swa", lambda self, loc: real(self, loc).flip(0))
    with pytest.raises(PoolfuzzFailure) as info:
        for _ in range(3):
            _serve(e)
            e.check()
    assert info.value.divergence.space == "swa", info.value


def test_a_door_that_drops_the_value_rows_is_caught(api, monkeypatch):
    e = _engine(api, "dense")
    pool = e.families["prefill"].sg_kv_pool
    real = type(pool).set_kv_buffer
    monkeypatch.setattr(type(pool), "set_kv_buffer",
                        lambda self, layer, loc, k, v, *a, **kw: real(self, layer, loc, k, v.clone().zero_(), *a, **kw))
    _serve(e)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert info.value.divergence.component == "full.v", info.value
