"""Tree verify (EAGLE topk 2, NGRAM) on SGLang's pools: the accepted path moves through the KV pool's ``move_kv_cache``."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from tests.sglang.families import dsa_move_is_page_aware

# One of each KV pool SGLang 0.5.23 moves rows in: MHA, SWA (through full_to_swa), hybrid-linear, MLA, DSA.
MOVING = ["dense", "swa-ps4", "hybrid-linear-ps4", "mla", "dsa-ps64"]


def _served(api, name) -> tuple[Engine, int]:
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    e = Engine(config=CONFIGS[name], family_factory=build_family)
    if not e.families["prefill"].supports_tree_drafts:
        pytest.skip(f"sglang {api.version}: its {name} KV pool cannot move a row on this machine")
    rid = e.admit(9)
    e.prefill(rid, 9)
    e.check()
    return e, rid


@pytest.mark.parametrize("name", MOVING)
def test_a_tree_verify_moves_the_accepted_path_through_the_pool(api, name, monkeypatch):
    e, rid = _served(api, name)
    if name == "dsa-ps64" and not dsa_move_is_page_aware(api):
        pytest.skip(f"sglang {api.version}: its DSA index move is page-unaware (test_a_page_unaware_dsa_move_is_caught)")
    cls = type(e.families["prefill"].sg_kv_pool)
    moved, real = [], cls.move_kv_cache

    def spy(self, tgt, src):
        moved.append((tgt.tolist(), src.tolist()))
        return real(self, tgt, src)

    monkeypatch.setattr(cls, "move_kv_cache", spy)
    assert e.decode_speculative(rid, 6, 3, tree=True)
    e.check()
    row = e.families["prefill"].req_pool.read(e.requests[rid].kv.req_pool_idx, 9, 16).tolist()
    assert moved == [(row[1:4], [row[2], row[4], row[6]])], moved  # the path's nodes 2, 4, 6 to the front
    e.decode([rid])
    e.check()


@pytest.mark.parametrize("name", MOVING)
def test_fuzz_with_tree_verifies_passes(api, fuzz, name):
    _served(api, name)
    if name == "dsa-ps64" and not dsa_move_is_page_aware(api):
        pytest.skip(f"sglang {api.version}: its DSA index move is page-unaware (test_a_page_unaware_dsa_move_is_caught)")
    outcome = fuzz(CONFIGS[name], examples=20)
    assert outcome.failure is None, outcome.failure


def test_a_move_that_skips_the_sliding_window_peers_is_caught(api, monkeypatch):
    """SGLang's SWAKVPool.move_kv_cache moves the SWA rows too, through full_to_swa; a move of the full rows
    alone (a planted defect) leaves the window layers reading the first branch's drafts."""
    e, rid = _served(api, "swa-ps4")
    cls = type(e.families["prefill"].sg_kv_pool)
    monkeypatch.setattr(cls, "move_kv_cache", lambda self, tgt, src: self.full_kv_pool.move_kv_cache(tgt, src))
    e.decode_speculative(rid, 6, 3, tree=True)
    with pytest.raises(PoolfuzzFailure) as info:
        e.check()
    assert info.value.divergence.space == "swa", info.value


def test_a_move_of_one_layer_only_is_caught(api, fuzz, monkeypatch):
    """A planted MHA move that carries the first layer only: the fuzzer finds the second layer's rows wrong."""
    from poolfuzz.adapters.sglang.api import load

    mha = load().MHATokenToKVPool

    def first_layer_only(self, tgt, src):
        self.k_buffer[0][tgt], self.v_buffer[0][tgt] = self.k_buffer[0][src], self.v_buffer[0][src]

    monkeypatch.setattr(mha, "move_kv_cache", first_layer_only)
    _served(api, "dense")
    outcome = fuzz(CONFIGS["dense"], examples=100, shrink=False)
    assert outcome.failure is not None, "a move that drops a layer was not caught"
    assert outcome.failure.divergence.layer == CONFIGS["dense"].full_layer_ids[1], outcome.failure


def test_a_page_unaware_dsa_move_is_caught(api, fuzz):
    """A real SGLang defect (0.5.18; fixed by 0.5.23): IndexKeyCache.move indexed the page-major index cache
    by token location, so a tree verify's move reads and writes the wrong page or none (an IndexError). The
    verify itself is driven here, so another defect of the release (0.5.13's DSA retraction) cannot mask
    it; on a release with the page-aware move a fuzz with tree verifies passes."""
    e, rid = _served(api, "dsa-ps64")
    if dsa_move_is_page_aware(api):
        assert fuzz(CONFIGS["dsa-ps64"], examples=20).failure is None
        return
    # Tokens 9..15 of page 1: a move by token location lands past the 5 pages (SGLang's own IndexError)
    # or on the wrong page (the index-key checksums).
    with pytest.raises((PoolfuzzFailure, IndexError)):
        e.decode_speculative(rid, 6, 3, tree=True)
        e.check()
