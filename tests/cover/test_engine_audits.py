"""The engine's audits: capability declarations, the SSM predicate, and messages that name whose data."""

import pytest
from poolfuzz.harness.engine import Engine, EngineOptions
from poolfuzz.harness.failures import InvariantViolation, ReferenceMismatch, StateLost
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family
from poolfuzz.pools.kv import SWAKVPool


class LyingSWAKVPool(SWAKVPool):
    """Carries the recurrent state in its CPU copy but still declares that it does not."""

    def get_cpu_copy(self, indices, mamba_indices=None):
        copy = super().get_cpu_copy(indices, mamba_indices)
        return (copy, self._mamba.get_cpu_copy(mamba_indices))

    def load_cpu_copy(self, cpu, indices, mamba_indices=None):
        super().load_cpu_copy(cpu[0], indices, mamba_indices)


def lying_family(config, **kwargs):
    fam = build_family(config, **kwargs)
    fam.kv_pool.__class__ = LyingSWAKVPool
    fam.kv_pool._mamba = fam.req_pool.mamba_pool
    return fam


def _prefilled(engine, prompt_len=3):
    rid = engine.admit(prompt_len)
    engine.check()
    engine.prefill(rid, prompt_len)
    engine.check()
    return rid


class TestCapabilityAudit:
    def test_a_pool_that_carries_state_it_does_not_declare_is_flagged(self):
        """cpu_copy_carries_mamba=False on a pool whose copy holds the state: the caller copies it twice."""
        engine = Engine(config=CONFIGS["swa-ssm"], family_factory=lying_family)
        rid = _prefilled(engine)
        with pytest.raises(InvariantViolation, match="declares cpu_copy_carries_mamba=False but its CPU copy "
                                                     r"of req 1 carried the recurrent state") as info:
            engine.retract(rid)
        assert info.value.divergence.kind == "capability"

    def test_honest_pools_pass_the_audit(self):
        """SWAKVPool (leaves the state) and HybridLinearKVPool (carries it) both declare the truth."""
        for name in ("swa-ssm", "hybrid-linear"):
            engine = Engine(config=CONFIGS[name])
            rid = _prefilled(engine)
            engine.retract(rid)
            engine.check()


class TestPredicateAudit:
    def test_recurrent_layers_under_a_non_ssm_architecture_are_flagged(self):
        """A new SSM architecture forgotten in uses_ssm_state is caught before any request runs."""
        forgotten = CONFIGS["swa-ssm"].replace(name="new-ssm", architecture="brand-new-ssm")
        with pytest.raises(InvariantViolation, match=r"uses_ssm_state\(new-ssm\) is False but the built family "
                                                     "has recurrent-state components") as info:
            Engine(config=forgotten)
        assert info.value.divergence.kind == "predicate"

    def test_ssm_architecture_without_recurrent_layers_is_flagged(self):
        """The converse disagreement is reported too."""
        odd = CONFIGS["dense"].replace(name="odd", architecture="mamba2")
        with pytest.raises(InvariantViolation, match="has no recurrent-state components"):
            Engine(config=odd)


class TestMessages:
    def test_reload_into_freed_slots_names_the_poison_and_the_move(self):
        """A reload into the old slots reports the slot before and after and whose data is there."""
        engine = Engine(config=CONFIGS["dense"], faults=["reload-into-old-indices"])
        rid = _prefilled(engine)
        engine.retract(rid)
        engine.check()
        other = _prefilled(engine, prompt_len=4)  # takes slots, moving the free list on
        assert other == 2
        engine.resume("prefill")
        with pytest.raises(StateLost) as info:
            engine.check()
        d = info.value.divergence
        assert (d.rid, d.op, d.component, d.position) == (1, "resume", "full.k", 0)
        assert d.slot_before is not None and d.slot_before != d.slot_after
        assert d.found.startswith(("poison (freed from req 1", "req 2 pos", "zeros"))
        assert str(info.value).startswith("StateLost: req 1 resumed; component full.k layer 0 position 0;")

    def test_a_leak_on_a_failed_resume_is_a_reference_mismatch(self):
        """A resume that runs out of KV must give back its mamba slot; the leak is named by pool."""
        # Resumes only when asked: the decodes below must not resume request 1 on their own.
        engine = Engine(config=CONFIGS["hybrid-linear"], faults=["mamba-leak-on-abort"],
                        options=EngineOptions(resume_after_decode=False))
        for _ in range(4):  # 4 x 10 tokens of 48, all 4 mamba slots
            _prefilled(engine, prompt_len=10)
        engine.retract(1)  # 18 tokens and one mamba slot free
        engine.check()
        for _ in range(3):  # three decodes of three requests: 9 tokens left, the resume needs 10
            engine.decode([2, 3, 4])
            engine.check()
        assert engine.resume("prefill") is None  # waits: full exhausted
        with pytest.raises(ReferenceMismatch, match="mamba pool has 0 free but the reference says 1"):
            engine.check()

    def test_a_decode_step_tries_to_resume_like_the_scheduler(self):
        """After a decode, the node's first retracted request is resumed if it fits (resume_retracted_reqs)."""
        engine = Engine(config=CONFIGS["dense"])
        first, second = _prefilled(engine), _prefilled(engine)
        engine.retract(first)
        engine.check()
        engine.decode([second])
        engine.check()
        assert engine.requests[first].verb == "resumed" and not engine.retracted["prefill"]
        assert engine.log[-1].op == "decode" and "resume: Req(1)" in engine.log[-1].outcome

    def test_a_decode_that_finds_no_slot_retracts_sglangs_victim(self):
        """retract_decode: the decode that runs out retracts the victim, then decodes in its room."""
        engine = Engine(config=CONFIGS["dense"])
        rids = [_prefilled(engine, prompt_len=12) for _ in range(4)]  # 4 x 12 of 48 tokens: full
        assert engine.decode([rids[0]]) == [rids[0]]
        engine.check()
        victim = rids[-1]  # no outputs yet, equal prompts: the last admitted
        assert engine.requests[victim].phase.value == "retracted"
        outcome = engine.log[-1].outcome
        assert f"full exhausted: retract Req({victim}), backup RetractionBackup(host_pool, tokens=12" in outcome
        # The resume after the decode needs the victim's 12 tokens back; 11 are free.
        assert outcome.endswith(f"resume: Req({victim}) waits: full exhausted")

    def test_the_victim_of_its_own_decode_waits_retracted(self):
        """When the request that ran out is SGLang's victim, it is retracted instead of decoded."""
        engine = Engine(config=CONFIGS["dense"])
        first, second = _prefilled(engine, prompt_len=24), _prefilled(engine, prompt_len=24)
        assert engine.decode([second]) == []
        engine.check()
        assert engine.retracted["prefill"] == [second] and engine.requests[first].phase.value == "running"

    def test_without_retract_on_oom_the_request_just_waits(self):
        engine = Engine(config=CONFIGS["dense"], options=EngineOptions(retract_on_decode_oom=False))
        rids = [_prefilled(engine, prompt_len=12) for _ in range(4)]
        assert engine.decode([rids[0]]) == []
        engine.check()
        assert not engine.retracted["prefill"] and engine.log[-1].outcome == "decoded []"

    def test_program_is_deterministic(self):
        """The same operations on two fresh engines give the same step log and slot choices."""
        logs = []
        for _ in range(2):
            engine = Engine(config=CONFIGS["swa-ssm-ps4"])
            rid = _prefilled(engine, 9)
            engine.decode([rid])
            engine.retract(rid)
            engine.resume("prefill")
            engine.check()
            logs.append([repr(s) for s in engine.log])
        assert logs[0] == logs[1]
