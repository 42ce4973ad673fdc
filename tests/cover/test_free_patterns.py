"""The free patterns SGLang's callers make, in the built-in family: free groups (a batch's frees go
back together at the group's end), and an abort between two chunks of a prefill."""

import pytest
import torch

from poolfuzz.harness.engine import Engine, Phase
from poolfuzz.harness.program import CannotRun, precondition
from poolfuzz.harness.records import StepRecord
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools import CONFIGS, PoolError, build_family
from poolfuzz.pools.allocator import TokenAllocator
from poolfuzz.pools.shortest_known import SHORTEST_KNOWN
from poolfuzz.pools.request import ReqKv
from poolfuzz.pools.swa_allocator import SWATokenAllocator


class TestFreeGroups:
    def test_a_group_frees_at_its_end_each_page_once(self):
        alloc = TokenAllocator(size=16, page_size=4)
        freed = []
        alloc.on_free = lambda space, slots: freed.append(slots.tolist())
        slots = alloc.alloc_extend(prefix_len=0, seq_len=7, last_loc=-1)  # two pages, the second part-used
        before = alloc.available_size()
        alloc.free_group_begin()
        alloc.free(slots[:5])  # the first page and part of the second
        alloc.free(slots[5:])  # the rest of the second page: one page, freed once at the end
        assert alloc.available_size() == before and freed == []
        alloc.free_group_end()
        assert alloc.available_size() == before + 8
        assert sorted(s for batch in freed for s in batch) == sorted(range(int(slots[0]), int(slots[0]) + 4)) + \
            sorted(range(int(slots[4]) // 4 * 4, int(slots[4]) // 4 * 4 + 4))

    def test_groups_do_not_nest(self):
        alloc = TokenAllocator(size=8, page_size=1)
        alloc.free_group_begin()
        with pytest.raises(PoolError, match="nested"):
            alloc.free_group_begin()

    def test_an_swa_group_unmaps_at_once_and_frees_both_sides_at_its_end(self):
        alloc = SWATokenAllocator(size=16, size_swa=16, page_size=2)
        slots = alloc.alloc_extend(prefix_len=0, seq_len=6, last_loc=-1)
        full, swa = alloc.full.available_size(), alloc.swa.available_size()
        alloc.free_group_begin()
        alloc.free_swa(slots[:3])  # a window eviction ending mid-page frees the whole page's peers
        assert torch.equal(alloc.translate(slots[:4]), torch.zeros(4, dtype=torch.int64))
        alloc.free(slots)
        assert (alloc.full.available_size(), alloc.swa.available_size()) == (full, swa)
        alloc.free_group_end()
        assert (alloc.full.available_size(), alloc.swa.available_size()) == (full + 6, swa + 6)


class TestAbortMidPrefill:
    @pytest.mark.parametrize("name", ["dense", "dense-ps4", "swa", "swa-ps4", "swa-ssm", "swa-ssm-ps4"])
    def test_an_abort_between_chunks_gives_everything_back(self, name):
        """Chunks of 3 and 2 tokens end mid-page at page size 4; the abort frees every slot."""
        engine = Engine(config=CONFIGS[name])
        rid = engine.admit(12)
        for chunk in (3, 2):
            assert engine.prefill(rid, chunk)
            engine.check()
        assert engine.requests[rid].phase is Phase.PREFILLING and engine.requests[rid].kv.kv_committed_len == 5
        engine.abort(rid)
        engine.check()
        engine.drain()  # check_whole: every pool is whole again

    def test_a_replayed_program_may_abort_mid_prefill_but_not_a_running_request(self):
        engine = Engine(config=CONFIGS["dense"])
        rid = engine.admit(8)
        engine.prefill(rid, 3)
        precondition(engine, StepRecord(op="abort", args={"rid": rid}, outcome=""), strict=True)
        engine.prefill(rid, 5)
        with pytest.raises(CannotRun, match="retracted"):
            precondition(engine, StepRecord(op="abort", args={"rid": rid}, outcome=""), strict=True)

    def test_the_machine_aborts_mid_prefill(self):
        """The rule is drawn: a run of the correct family takes it and passes."""
        result = run_machine(CONFIGS["swa-ps4"], max_examples=60, seed=3)
        assert result.passed, result.failure


@pytest.mark.parametrize(("fault", "config", "signature"), [
    ("free-group-drops-swa", "swa", "ReferenceMismatch:free-count:swa"),
    ("free-group-drops-swa", "swa-ssm-ps4", "ReferenceMismatch:free-count:swa"),
    ("abort-prefill-leaks-last-chunk", "dense", "ReferenceMismatch:free-count:full"),
    ("abort-prefill-leaks-last-chunk", "hybrid-linear-ps4", "ReferenceMismatch:free-count:full"),
])
def test_each_free_pattern_fault_is_found(fault, config, signature):
    result = run_machine(CONFIGS[config], faults=[fault], max_examples=200, seed=0, shrink_limit=10)
    assert not result.passed and result.signature == signature, result.failure
    assert SHORTEST_KNOWN[fault] >= 1


def test_an_abort_mid_prefill_releases_on_the_family_directly():
    family = build_family(CONFIGS["swa-ps4"])
    rows, full = family.req_pool.rows.available_size(), family.allocator.full_available_size()
    req = ReqKv(rid=1, seqlen=10)
    family.protocol.admit(req, family)
    family.protocol.extend(req, family, 5)
    req.kv_committed_len = 5
    family.protocol.abort(req, family)
    assert family.req_pool.rows.available_size() == rows and family.allocator.full_available_size() == full


@pytest.mark.parametrize(("fault", "config", "program"), [
    # a prompt longer than the window, prefilled: its finish at teardown is a grouped release
    ("free-group-drops-swa", "swa", [("admit", {"prompt_len": 10}), ("prefill", {"rid": 1, "chunk": 10})]),
    ("abort-prefill-leaks-last-chunk", "dense",
     [("admit", {"prompt_len": 8}), ("prefill", {"rid": 1, "chunk": 3}), ("abort", {"rid": 1})]),
])
def test_the_shortest_known_programs_fail(fault, config, program):
    """SHORTEST_KNOWN is a program that exists: this one, of that length, fails (at a step or at teardown)."""
    assert len(program) == SHORTEST_KNOWN[fault]
    engine = Engine(config=CONFIGS[config], faults=(fault,))
    with pytest.raises(Exception, match="free"):
        for op, args in program:
            getattr(engine, op)(**args)
            engine.check()
        engine.drain()
    clean = Engine(config=CONFIGS[config])
    for op, args in program:
        getattr(clean, op)(**args)
        clean.check()
    clean.drain()
