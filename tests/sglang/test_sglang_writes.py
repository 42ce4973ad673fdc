"""The forward's KV rows go through SGLang's own write door (``set_kv_buffer``), which files them by layer,
sub-pool and slot; the checksums then say whether it filed them where the request's slots are."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import casts_fp8_twice


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


def _verify(e, *, draft=3, accepted=1):
    rid = e.admit(7)
    e.prefill(rid, 7)
    e.decode([rid])
    assert e.decode_speculative(rid, draft, accepted)
    return rid


def _prefix_door(api, e):
    pool = e.families["prefill"].sg_kv_pool
    if getattr(type(pool), "set_kv_buffer_prefix_valid", None) is None:
        pytest.skip(f"sglang {api.version}'s MHA pool has no prefix-valid door")
    return type(pool)


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "dense-cpu-fp8"])
def test_a_chain_verify_commits_its_accepted_prefix_through_the_prefix_valid_door(api, monkeypatch, name):
    """DFlash's commit: one ``set_kv_buffer_prefix_valid`` per layer and verify, the window's slots as one
    row and its verified length (the input token and the accepted draft); the checksums pass, except on a
    release that casts fp8 rows twice there (dense-ps4 stores fp8), where they name the garbage."""
    e = _engine(api, name)
    cls = _prefix_door(api, e)
    garbled = CONFIGS[name].kv_dtype.startswith("fp8") and casts_fp8_twice(api)  # probed before the spy goes in
    real = cls.set_kv_buffer_prefix_valid
    seen = []
    monkeypatch.setattr(cls, "set_kv_buffer_prefix_valid", lambda self, layer, loc_2d, lens, k, v, *a, **kw: (
        seen.append((layer.layer_id, tuple(loc_2d.shape), lens.tolist())), real(self, layer, loc_2d, lens, k, v, *a, **kw))[1])
    if garbled:
        with pytest.raises(PoolfuzzFailure, match="unrecognised bytes") as info:
            _verify(e, draft=3, accepted=1)
            e.check()
        assert info.value.divergence.component == "full.k" and info.value.divergence.position == 8, info.value
        return
    _verify(e, draft=3, accepted=1)
    e.check()
    assert sorted(seen) == [(lid, (1, 4), [2]) for lid in CONFIGS[name].full_layer_ids]


def test_a_prefix_valid_door_that_drops_the_last_verified_row_is_caught(api, monkeypatch):
    """A commit that keeps one row too few (``<`` where ``<=`` was meant): the accepted draft's KV is never
    written, and the next check finds the slot without it."""
    e = _engine(api, "dense")
    cls = _prefix_door(api, e)
    real = cls.set_kv_buffer_prefix_valid
    monkeypatch.setattr(cls, "set_kv_buffer_prefix_valid",
                        lambda self, layer, loc_2d, lens, *a, **kw: real(self, layer, loc_2d, lens - 1, *a, **kw))
    with pytest.raises(PoolfuzzFailure) as info:
        _verify(e, draft=3, accepted=1)
        e.check()
    assert (info.value.divergence.component, info.value.divergence.position) == ("full.k", 9), info.value
