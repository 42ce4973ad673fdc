"""Prefix hits inside a block (vLLM's fine-grained hashes with a mamba "align" group, from ~0.32).

The family hashes every token of an align hybrid on 4-token pages (``--prefix-match-unit 1``). A
prompt's prefill then stops at its last token boundary, where the state is checkpointed and keyed
inside its block, along with the attention block holding that boundary; the producer's next step
moves the state's key to a copy before it writes on. A later request hitting that prefix copies the
hit's tail block on write in both groups. Each test drives that as vLLM's scheduler does and checks
it, and the injected defects (a worker that skips the copies, a manager that keeps the key on the
block its producer overwrites) are caught.
"""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.records import Phase
from poolfuzz.pools.config import CONFIGS

NAME = "hybrid-extra-buffer-ps4"


@pytest.fixture
def fine(api):
    if not api.partial_hash_hits or "align" not in api.mamba_cache_modes:
        pytest.skip(f"vLLM {api.version} takes no prefix hit inside a block")
    return api


def _factory():
    from poolfuzz.adapters.vllm import build_manager_family as build_family

    return build_family


def _served_and_finished(prompt: int, patch=None):
    engine = Engine(config=CONFIGS[NAME], family_factory=_factory())
    if patch is not None:
        patch(engine.families["prefill"])
    a = engine.admit(prompt)
    chunks = []
    while engine.requests[a].phase is Phase.PREFILLING:
        assert engine.prefill(a, prompt)
        chunks.append(engine.log[-1].outcome)
        engine.check()
    engine.finish(a)
    engine.check()
    return engine, a, chunks


class TestSubBlockHits:
    def test_the_prefill_stops_at_the_prompts_last_token_boundary(self, fine):
        engine, a, chunks = _served_and_finished(7)
        assert engine.families["prefill"].built.hash_block_size == 1
        assert chunks == ["positions 0..4", "positions 4..6", "positions 6..7"]

    def test_a_next_turn_hits_inside_a_block_and_copies_its_tail_block(self, fine):
        engine, a, _ = _served_and_finished(7)
        fam = engine.families["prefill"]
        keyed = {b.block_id for b in fam.block_pool.blocks if b.block_hash is not None}
        rid = engine.next_turn(a, 1)
        assert engine.log[-1].outcome == f"Req({rid}) prefix 7 hit 6 external 0", engine.log[-1]
        full, mamba = fam.block_ids(fam.live[rid], "full"), fam.block_ids(fam.live[rid], "mamba")
        assert full[0] in keyed  # the whole block, shared
        assert full[1] not in keyed and mamba[1] not in keyed  # the tail block inside the hit: a copy
        assert mamba[0] == 0
        engine.check()  # positions 4 and 5 came with the copy, the state after 6 tokens too
        while engine.requests[rid].phase is Phase.PREFILLING:
            assert engine.prefill(rid, 16)
        engine.decode([rid])
        engine.check()
        engine.finish(rid)
        engine.sweep()
        engine.drain()

    def test_a_worker_that_skips_the_copies_is_caught(self, fine):
        engine, a, _ = _served_and_finished(7)
        import poolfuzz.adapters.vllm.family as family_module

        real = family_module.copy_block
        family_module.copy_block = lambda *args: None
        try:
            with pytest.raises(StateLost, match="hit a cached state after 6 tokens"):
                engine.next_turn(a, 1)
        finally:
            family_module.copy_block = real

    def test_a_key_left_on_the_block_its_producer_overwrites_is_caught(self, fine):
        """A manager that copies the producer's checkpoint but keeps its key on the block the producer
        then writes the next state into: the later hit finds the state after 7 tokens, not 6."""
        def keep_keys(fam):
            fam.block_pool.move_block_hashes = lambda src, dst: None

        engine, a, _ = _served_and_finished(7, keep_keys)
        with pytest.raises(StateLost, match="hit a cached state after 6 tokens"):
            engine.next_turn(a, 1)

    @pytest.mark.parametrize("spare", [0, 1])
    def test_the_producers_next_step_counts_the_copy_of_its_keyed_state(self, fine, spare):
        """A 3-token prompt: the chunk 0..2 leaves the state after 2 tokens keyed in its block; the
        chunk 2..3 needs no new block, but vLLM's check counts the copy the key moves to (back in the
        free queue, cached, once copied): with no free block the chunk waits, with one it runs, as the
        reference says (the engine compares them)."""
        engine = Engine(config=CONFIGS[NAME], family_factory=_factory())
        a = engine.admit(3)
        assert engine.prefill(a, 3)
        assert engine.log[-1].outcome == "positions 0..2"
        fam, ref = engine.families["prefill"], engine.refs["prefill"]
        pool = fam.block_pool
        free = [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
        pool.touch(free[spare:])  # other requests hold these
        ref.free["full"] -= len(free) - spare
        assert engine.prefill(a, 3) == bool(spare)
        assert engine.log[-1].outcome == ("positions 2..3" if spare else "full exhausted")
        if spare:
            copy = [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
            assert len(copy) == 1 and copy[0].block_hash is not None  # the copy, keyed, free
            engine.check()

    def test_a_load_past_the_hits_tail_supersedes_it(self, fine):
        """The connector holds the whole blocks to 8: the scheduler cuts the local hit to its block
        boundary (4) and loads the rest, so nothing is copied on write and no hit state is read."""
        engine, a, _ = _served_and_finished(7)
        fam = engine.families["prefill"]
        rid = engine.next_turn(a, 3)
        assert engine.log[-1].outcome == f"Req({rid}) prefix 7 hit 4 external 4", engine.log[-1]
        assert fam.manager.take_kv_cache_block_copies() == ([], [])
        engine.check()

    def test_a_hit_inside_a_block_counts_its_copies_as_vllm_does(self, fine):
        """An 8-token next turn hitting 6 of a finished 7-token request takes 2 attention blocks (the
        whole one, the copy of the hit's tail one) and a state block (the copy); vLLM's check also
        counts the two tail blocks it reads (they come back once copied): 5 free blocks, not 3."""
        assert _fits_by_free(extra=1, outcome="hit 6 external 0", taken=3) == 5

    def test_a_load_that_cuts_the_hit_counts_no_hit_state(self, fine):
        """A 9-token next turn: the load from 4 to 8 cuts the hit to 4, whose mamba blocks are then
        null only; the turn takes 2 attention blocks and the loaded state's block, and vLLM's check
        counts no hit state block for it: 3 free blocks suffice."""
        assert _fits_by_free(extra=2, outcome="hit 4 external 4", taken=3, reads_only_block_0=True) == 3


def _fits_by_free(*, extra: int, outcome: str, taken: int, reads_only_block_0: bool = False) -> int:
    """The fewest free blocks with which the next turn of a finished 7-token request fits. With every
    free block but ``spare`` held by others (uncached ones first, then cached ones the turn does not
    read: all but the attention block of the first 4 tokens when ``reads_only_block_0``), the turn
    must wait or fit as the reference says (the engine compares them at every step); it then takes
    ``taken`` blocks."""
    fits = {}
    for spare in range(5):
        engine, a, _ = _served_and_finished(7)
        fam, ref = engine.families["prefill"], engine.refs["prefill"]
        pool = fam.block_pool
        free_blocks = [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
        holdable = [b for b in free_blocks if b.block_hash is None]
        if reads_only_block_0:
            full = fam.group_of["full"].index
            holdable += [b for b in free_blocks if b.block_hash is not None and not (
                fam.api.kv_cache_utils.get_group_id(b.block_hash) == full and b.block_hash_num_tokens == 4)]
        pool.touch(holdable[spare:])  # other requests hold (or hit) these
        ref.free["full"] -= len(holdable) - spare
        free = pool.get_num_free_blocks()
        assert free == ref._shared_free()
        rid = engine.next_turn(a, extra)
        fits[free] = rid is not None
        if rid is not None:
            assert engine.log[-1].outcome == f"Req({rid}) prefix 7 {outcome}", engine.log[-1]
            assert pool.get_num_free_blocks() == free - taken
            engine.check()
        else:
            assert engine.log[-1].outcome == "full exhausted"
    least = min(f for f, ok in fits.items() if ok)
    assert fits == {f: f >= least for f in fits} and not all(fits.values()), fits
    return least


def test_a_release_without_sub_block_hits_hashes_by_the_block(api):
    if api.partial_hash_hits:
        pytest.skip(f"vLLM {api.version} takes hits inside a block")
    fam = _factory()(CONFIGS[NAME])
    assert fam.built.hash_block_size == CONFIGS[NAME].page_size
