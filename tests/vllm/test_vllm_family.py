"""The vllm family: vLLM's real v1 KVCacheManager under the harness, its tensors and its checks."""

from __future__ import annotations

import pytest

from poolfuzz.harness import contract
from poolfuzz.harness.contract import check_family
from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import InvariantViolation
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError

NAMES = list(CONFIGS)


def _build(name):
    from poolfuzz.adapters.vllm import build_manager_family as build_family

    return build_family(CONFIGS[name])


class TestContract:
    @pytest.mark.parametrize("name", NAMES)
    def test_family_contract(self, api, name, monkeypatch):
        from poolfuzz.adapters.vllm import build_manager_family as build_family, unsupported_reason

        reason = unsupported_reason(CONFIGS[name])
        if reason is not None:  # a dimension the adapter does not drive: declined with its reason, never run
            c = CONFIGS[name]
            assert (c.attention != "mha" or c.kv_scale_block or c.mamba_track_slots or c.spec_draft_tokens
                    or c.kv_quant or not c.full_layer_ids)
            with pytest.raises(ConfigError, match="cannot build"):
                build_family(CONFIGS[name])
            return
        # The contract's program without its retraction and resume: the family declares none (supports_retract).
        assert build_family(CONFIGS[name]).supports_retract is False
        monkeypatch.setattr(contract, "PROGRAM", [s for s in contract.PROGRAM if s[0] not in ("retract", "resume")])
        check_family(build_family, CONFIGS[name])

    @pytest.mark.parametrize("name", ["dense", "swa-ssm-ps4"])
    def test_block_spaces_are_one_pool(self, api, name):
        """Every group's free list is vLLM's own BlockPool count: allocating in one moves them all."""
        fam = _build(name)
        spaces = [s for s in fam.free_lists() if s != "rows"]
        before = {s: fam.free_lists()[s].available_size() for s in spaces}
        fam.block_pool.get_new_blocks(1)
        for s in spaces:
            scale = fam.free_lists()[s].scale
            assert fam.free_lists()[s].available_size() == before[s] - scale, s

    def test_the_family_declares_its_engine_code(self, api):
        from poolfuzz.adapters.vllm import build_manager_family as build_family

        assert build_family.engine_code == ("vllm/v1/core",)

    def test_faults_are_refused(self, api):
        from poolfuzz.adapters.vllm import build_manager_family as build_family

        with pytest.raises(ConfigError, match="no catalogue faults"):
            build_family(CONFIGS["dense"], faults=("x",))


class TestChecks:
    def test_a_written_null_block_is_reported(self, api):
        """Block 0 pads every block table: a write there is caught by the free-list check."""
        fam = _build("dense")
        assert fam.free_lists()["full"].free_list_problem() is None
        fam.components()[0].tensor[0] = 1
        assert "null block 0 was written" in fam.free_lists()["full"].free_list_problem()

    def test_a_block_in_two_groups_names_the_block_and_both_groups(self, api):
        """The shared-unit audit: a block handed to the SWA group while the full group holds it."""
        engine = Engine(config=CONFIGS["swa"], family_factory=_factory())
        rid = engine.admit(4)
        engine.prefill(rid, 4)
        engine.check()
        fam = engine.families["prefill"]
        live = fam.live[rid]
        full_block = fam.block_ids(live, "full")[0]
        swa_manager = fam.manager.coordinator.single_type_managers[fam.group_of["swa"].index]
        blocks = swa_manager.req_to_blocks[live.request.request_id]
        blocks[-1] = fam.block_pool.blocks[full_block]  # what vLLM before #44409 could do
        with pytest.raises(InvariantViolation, match=rf"block {full_block} .*two KV cache groups: full \(req {rid}\) "
                                                     rf"and swa \(req {rid}\)"):
            engine.check()


def _factory():
    from poolfuzz.adapters.vllm import build_manager_family as build_family

    return build_family


class TestFlush:
    @pytest.mark.parametrize("name", ["dense-ps4", "hybrid-linear"])
    def test_a_mid_run_reset_of_the_prefix_cache_serves_on(self, api, name):
        """reset_prefix_cache on an idle node (as RL frameworks call it after a weight update): every block
        free again, a finished request's next turn finds nothing cached, and the node serves on."""
        engine = Engine(config=CONFIGS[name], family_factory=_factory())
        a = engine.admit(9)
        engine.prefill(a, 9)
        engine.decode([a])
        engine.finish(a)
        engine.check()
        engine.flush("prefill")
        engine.check()
        b = engine.next_turn(a, 3)
        assert "hit 0" in engine.log[-1].outcome, engine.log[-1]
        engine.prefill(b, 13)
        engine.decode([b])
        engine.check()
        engine.sweep()
        engine.drain()


class TestFuzz:
    @pytest.mark.parametrize("name", ["dense", "swa-ps4", "hybrid-linear"])
    def test_fuzz_finds_nothing_on_non_anchor_configs(self, api, fuzz, name):
        """On every release, #44409's too: its next turns bring no connector tokens, which that bug needs."""
        outcome = fuzz(CONFIGS[name], examples=30)
        assert outcome.failure is None, outcome.failure


class TestNextTurn:
    def _served_and_finished(self):
        engine = Engine(config=CONFIGS["dense-ps4"], family_factory=_factory())
        a = engine.admit(13)
        engine.prefill(a, 13)
        engine.check()
        fam = engine.families["prefill"]
        blocks = fam.block_ids(fam.live[a], "full")
        engine.finish(a)
        engine.check()
        return engine, a, blocks

    def test_a_next_turn_hits_the_finished_blocks_and_reads_what_was_cached(self, api):
        engine, a, blocks = self._served_and_finished()
        rid = engine.next_turn(a, 3)
        assert engine.log[-1].outcome.startswith(f"Req({rid}) prefix 13 hit 12"), engine.log[-1]
        fam = engine.families["prefill"]
        assert fam.block_ids(fam.live[rid], "full")[:3] == blocks[:3]  # the cached blocks, revived
        engine.check()
        engine.prefill(rid, 16)
        engine.decode([rid])
        engine.check()
        assert a not in engine.finished  # a conversation continues once
        engine.sweep()
        engine.drain()

    def test_a_cached_block_changed_while_free_is_caught_at_the_hit(self, api):
        from poolfuzz.harness.failures import PoolfuzzFailure

        engine, a, blocks = self._served_and_finished()
        fam = engine.families["prefill"]
        for comp in fam.components():
            if comp.space == "full":  # the first position of the first cached block, in every layer
                comp.tensor[blocks[0] * CONFIGS["dense-ps4"].page_size] += 1
        rid = engine.next_turn(a, 3)
        with pytest.raises(PoolfuzzFailure, match=f"req {rid}"):
            engine.check()
