"""The scheduler's side of vLLM's manager that vllm:manager drives (KV events, prefix-cache reset) and what it
leaves to vLLM's own Scheduler (``--family vllm``): mamba "align", preemption, a KV connector's tokens."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.records import Phase
from poolfuzz.pools.config import CONFIGS


def _factory():
    from poolfuzz.adapters.vllm import build_manager_family as build_family

    return build_family


def _served_and_finished(name: str, prompt: int):
    engine = Engine(config=CONFIGS[name], family_factory=_factory())
    a = engine.admit(prompt)
    while engine.requests[a].phase is Phase.PREFILLING:  # align mode splits the prompt at a block boundary
        assert engine.prefill(a, prompt)
    engine.check()
    engine.finish(a)
    engine.check()
    return engine, a


class TestKvEvents:
    def test_the_event_stream_matches_the_prefix_cache(self, api):
        engine, a = _served_and_finished("swa-ps4", 13)
        fam = engine.families["prefill"]
        if fam.events is None:
            pytest.skip(f"vLLM {api.version} publishes no group in its KV events")
        assert sum(fam.events.cached.values()) > 0  # the finished request's full blocks were stored
        assert fam.events.problem is None

    def test_a_removal_of_a_hash_never_stored_is_reported(self, api):
        """A router that is told to forget a block it never learned: the stream disagrees with the cache."""
        engine, a = _served_and_finished("dense-ps4", 13)
        fam = engine.families["prefill"]
        if fam.events is None:
            pytest.skip(f"vLLM {api.version} publishes no group in its KV events")
        fam.block_pool.kv_event_queue.append(
            fam.api.kv_events.BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU", group_idx=0))
        fam.end_of_schedule()
        assert "remove hash 010101010101 of group 0, which no event stored" in fam.free_lists()["full"].free_list_problem()


    def test_a_cached_block_the_stream_never_stored_is_reported(self, api):
        """As if a BlockStored had been lost: the cache holds one block more under a hash than the stream says."""
        engine, a = _served_and_finished("dense-ps4", 13)
        fam = engine.families["prefill"]
        if fam.events is None:
            pytest.skip(f"vLLM {api.version} publishes no group in its KV events")
        key = next(iter(fam.events.cached))
        fam.events.cached[key] -= 1
        fam.events.problem = None
        fam.end_of_schedule()
        assert "the prefix cache holds 1 block(s) under hash" in fam.free_lists()["full"].free_list_problem()
        assert "but the KV events say 0" in fam.free_lists()["full"].free_list_problem()


class TestPrefixCacheReset:
    def test_a_drained_node_resets_and_no_longer_hits(self, api):
        engine, a = _served_and_finished("dense-ps4", 13)
        fam = engine.families["prefill"]
        fam.flush_prefix_cache()
        assert fam.reset_refused is None
        assert not any(b.block_hash is not None for b in fam.block_pool.blocks)
        rid = engine.next_turn(a, 3)
        assert engine.log[-1].outcome.startswith(f"Req({rid}) prefix 13 hit 0"), engine.log[-1]
        engine.check()

    def test_a_refused_reset_is_a_leak(self, api):
        """vLLM resets only when every block is free: with every request finished, a refusal means leaked blocks."""
        engine, a = _served_and_finished("dense-ps4", 13)
        fam = engine.families["prefill"]
        fam.block_pool.get_new_blocks(2)  # taken and never given back
        fam.flush_prefix_cache()
        assert "reset_prefix_cache refused with every request finished: 2 block(s)" in \
            fam.free_lists()["full"].free_list_problem()


class TestWhatOnlyTheSchedulerDecides:
    """vllm:manager restates no scheduler decision: what only vLLM's Scheduler decides is declined or not driven."""

    @pytest.mark.parametrize("name", ["hybrid-extra-buffer", "hybrid-extra-buffer-ps4"])
    def test_an_align_config_is_declined_pointing_to_the_scheduler_family(self, api, name):
        """Where an "align" prefill chunk ends and which cached state a request continues from are the scheduler's."""
        from poolfuzz.adapters.vllm import build_manager_family, scheduler_unsupported_reason, unsupported_reason
        from poolfuzz.pools.errors import ConfigError

        reason = unsupported_reason(CONFIGS[name])
        if "align" not in api.mamba_cache_modes:
            assert "has no mamba cache mode 'align'" in reason, reason
            return
        assert 'mamba cache mode "align" is driven only through vLLM\'s own Scheduler' in reason, reason
        assert reason.endswith("run it with --family vllm"), reason
        with pytest.raises(ConfigError, match=f"vllm:manager cannot build '{name}': .*--family vllm"):
            build_manager_family(CONFIGS[name])
        assert scheduler_unsupported_reason(CONFIGS[name]) is None  # the scheduler path drives it

    def test_a_mamba_config_in_mode_none_still_builds(self, api):
        fam = _factory()(CONFIGS["hybrid-linear"])
        assert fam.mamba_mode == "none" and not fam.prefix_caching

    def test_no_request_is_preempted(self, api):
        """``Scheduler._preempt_request`` picks and frees the victim: the family declares no retraction, and a
        decode that finds no block retracts nothing."""
        fam = _factory()(CONFIGS["dense-ps4"])
        assert fam.supports_retract is False
        engine = Engine(config=CONFIGS["dense-ps4"], family_factory=_factory())
        assert engine.sglang_victim("prefill") is None

    def test_a_next_turn_gets_no_connector_tokens(self, api):
        """The lookup is ``get_computed_blocks`` alone, also where ``allocate_slots`` takes a connector's tokens (which
        held this turn's whole blocks up to 20 before): the scheduler's connector rules run only on ``--family vllm``."""
        engine, a = _served_and_finished("swa-ps4", 13)
        rid = engine.next_turn(a, 8)
        assert engine.log[-1].outcome == f"Req({rid}) prefix 13 hit 12 external 0", engine.log[-1]
        engine.check()
        engine.prefill(rid, 21)
        engine.decode([rid])
        engine.check()
        engine.sweep()
        engine.drain()
