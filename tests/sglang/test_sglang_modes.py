"""SGLang's mamba extra-buffer mode (ping-pong track slots) on the release's own pools, through the harness."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.pools.config import CONFIGS

EXTRA_BUFFER = ["hybrid-extra-buffer", "hybrid-extra-buffer-ps4"]


def _supported(api, config):
    from poolfuzz.adapters.sglang import unsupported_reason

    why = unsupported_reason(config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")


def _engine(config):
    from poolfuzz.adapters.sglang import build_family

    return Engine(config=config, family_factory=build_family)


class TestExtraBuffer:
    def test_track_slots_are_sglang_s_and_freed_with_the_request(self, api):
        """``alloc`` gives the request its state slot and a ping-pong pair from the same allocator, mapped
        per row; finishing the request frees all three."""
        config = CONFIGS["hybrid-extra-buffer"]
        _supported(api, config)
        e = _engine(config)
        fam = e.families["prefill"]
        free_before = fam.free_lists()["mamba"].available_size()
        rid = e.admit(6)
        e.check()
        kv = e.requests[rid].kv
        assert len(kv.mamba_track) == 2 and len({kv.mamba_pool_idx, *kv.mamba_track}) == 3
        assert fam.req_pool.get_track_slots(kv.req_pool_idx) == list(kv.mamba_track)
        assert fam.free_lists()["mamba"].available_size() == free_before - 3
        e.prefill(rid, 6)
        e.check()
        e.decode([rid])
        e.check()
        e.finish(rid)
        e.check()
        assert fam.free_lists()["mamba"].available_size() == free_before

    def test_forwards_write_the_track_slots_in_turn(self, api):
        """The scheduler's ``mamba_next_track_idx`` alternates: the prefill's state stays in one slot while
        the decode writes the other, and each holds what the reference says."""
        config = CONFIGS["hybrid-extra-buffer"]
        _supported(api, config)
        e = _engine(config)
        fam = e.families["prefill"]
        rid = e.admit(5)
        e.prefill(rid, 5)
        e.decode([rid])
        e.check()  # every track slot's checksum is compared here
        kv = e.requests[rid].kv
        temporal = next(c for c in fam.components() if c.name == "mamba.temporal")
        first, second = (temporal.tensor[s] for s in kv.mamba_track)
        assert not torch.equal(first, second)
        assert torch.equal(second, temporal.tensor[kv.mamba_pool_idx])

    @pytest.mark.parametrize("name", EXTRA_BUFFER)
    def test_fuzz_passes(self, api, fuzz, name):
        _supported(api, CONFIGS[name])
        outcome = fuzz(CONFIGS[name], examples=15)
        assert outcome.failure is None, outcome.failure

    def test_a_pool_that_never_alternates_is_caught(self, api, fuzz, monkeypatch):
        """With ``get_mamba_ping_pong_other_idx`` stuck on one index, one track slot is written by every
        forward and the other never: the slot that should hold the previous step's state does not."""
        config = CONFIGS["hybrid-extra-buffer"]
        _supported(api, config)
        monkeypatch.setattr(api.HybridReqToTokenPool, "get_mamba_ping_pong_other_idx", lambda self, idx: idx)
        outcome = fuzz(config, examples=30)
        assert outcome.failure is not None, "track slots that never alternate were not caught"
        assert outcome.failure.divergence.space == "mamba", outcome.failure

    def test_track_slots_kept_on_release_are_a_leak(self, api, fuzz, monkeypatch):
        """``free_mamba_cache`` keeping a ping-pong entry (as if the tree took it) with no tree to take it: a leak."""
        config = CONFIGS["hybrid-extra-buffer"]
        _supported(api, config)
        real = api.HybridReqToTokenPool.free_mamba_cache
        monkeypatch.setattr(api.HybridReqToTokenPool, "free_mamba_cache",
                            lambda self, req, keep=None: real(self, req, 0))
        outcome = fuzz(config, examples=30)
        assert outcome.failure is not None, "a kept track slot was not caught"
        assert outcome.failure.divergence.space == "mamba", outcome.failure

    def test_an_unwritten_track_mapping_is_caught(self, api, fuzz, monkeypatch):
        """The attention backend reads the track slots from the row mapping; a pool that leaves it stale is
        caught by the consumer-map check."""
        config = CONFIGS["hybrid-extra-buffer"]
        _supported(api, config)
        real = api.HybridReqToTokenPool.alloc

        def alloc(self, reqs):
            got = real(self, reqs)
            if got is not None:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping[torch.as_tensor(got)] = 0
            return got

        monkeypatch.setattr(api.HybridReqToTokenPool, "alloc", alloc)
        outcome = fuzz(config, examples=10)
        assert outcome.failure is not None
        assert outcome.failure.divergence.check == "consumer-map", outcome.failure


SPECULATIVE = ["hybrid-spec", "hybrid-spec-ps4"]


class TestSpeculativeScratch:
    def test_scratch_components_are_the_pool_s_intermediate_caches(self, api):
        """Every draft step of every state tensor is a view of SGLang's intermediate_ssm / conv windows."""
        config = CONFIGS["hybrid-spec"]
        _supported(api, config)
        e = _engine(config)
        fam = e.families["prefill"]
        caches = fam.sg_req_pool.get_speculative_mamba2_params_all_layers()
        storages = {t.untyped_storage().data_ptr() for t in [caches.intermediate_ssm, *caches.intermediate_conv_window]}
        scratch = [c for c in fam.components() if "@draft" in c.name]
        per_step = len(config.conv_shapes) + 1
        assert len(scratch) == per_step * config.mamba_layers * config.spec_draft_tokens
        assert all(c.tensor.untyped_storage().data_ptr() in storages and c.space == "rows" for c in scratch)

    def test_a_verify_and_commit_pass_the_checks(self, api):
        config = CONFIGS["hybrid-spec"]
        _supported(api, config)
        e = _engine(config)
        rid = e.admit(5)
        e.prefill(rid, 5)
        for draft, accepted in ((3, 1), (2, 2), (1, 0)):
            assert e.decode_speculative(rid, draft=draft, accepted=accepted)
            e.check()
        e.decode([rid])
        e.check()

    @pytest.mark.parametrize("name", SPECULATIVE)
    def test_fuzz_passes(self, api, fuzz, name):
        _supported(api, CONFIGS[name])
        outcome = fuzz(CONFIGS[name], examples=15)
        assert outcome.failure is None, outcome.failure

    def test_a_commit_from_the_wrong_buffer_is_caught(self, api, fuzz, monkeypatch):
        """If the accessor the backend commits from handed out another intermediate_ssm than the one the
        verify wrote, the committed state is zeros: caught on the next check."""
        config = CONFIGS["hybrid-spec"]
        _supported(api, config)
        real = api.MambaPool.get_speculative_mamba2_params_all_layers
        seen = set()

        def accessor(self):
            caches = real(self)
            if id(self) not in seen:  # each family takes its scratch views from its pool's first call
                seen.add(id(self))
                return caches
            import dataclasses
            return dataclasses.replace(caches, intermediate_ssm=torch.zeros_like(caches.intermediate_ssm))

        monkeypatch.setattr(api.MambaPool, "get_speculative_mamba2_params_all_layers", accessor)
        e = _engine(config)
        rid = e.admit(5)
        e.prefill(rid, 5)
        e.check()
        e.decode_speculative(rid, draft=2, accepted=1)
        from poolfuzz.harness.failures import PoolfuzzFailure

        with pytest.raises(PoolfuzzFailure, match="mamba.temporal"):
            e.check()
