"""Per-step cost is bounded by the step's own work and does not grow with the pool (no timing).

The engine counts every checksum call and every slot it checksums (``engine.stats``); these tests
hold those counts to what the step touched, and run the same programs on a 64-slot pool and on a
million-slot pool to show that nothing per step (nor building an engine) walks the pool.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poolfuzz.harness.engine import Engine, EngineOptions, Phase
from poolfuzz.pools.allocator import FreeList, TokenAllocator
from poolfuzz.pools.config import CONFIGS

SMALL = CONFIGS["swa-ssm"]
LARGE = SMALL.replace(name="swa-ssm-1m", full_tokens=1 << 20, swa_tokens=1 << 20)
NO_SWEEP = EngineOptions(sweep_interval=0)


def _bound(engine: Engine, rids) -> tuple[int, int]:
    """(checksum calls, slots) a check of these requests may cost: per component, the positions
    of each request that the component holds (full: committed; SWA: the window; mamba: one)."""
    comps = engine.families["prefill"].components()
    per_space: dict[str, int] = {}
    for c in comps:
        per_space[c.space] = per_space.get(c.space, 0) + 1
    slots = 0
    for rid in rids:
        req = engine.requests.get(rid)
        if req is None or req.phase is Phase.RETRACTED:
            continue
        committed = req.kv.kv_committed_len
        slots += per_space.get("full", 0) * committed
        slots += per_space.get("swa", 0) * min(committed, engine.config.sliding_window)
        slots += per_space.get("mamba", 0)
    return len(comps) * len(engine.families), slots


def _program(engine: Engine):
    """A fixed program touching one request at a time while others stay live: yields after each step."""
    rids = [engine.admit(6) for _ in range(3)]
    yield
    for rid in rids:
        engine.prefill(rid, 6)
        yield
    for _ in range(4):
        engine.decode([rids[0]])
        yield
    engine.evict_swa()
    yield
    engine.retract(rids[1])
    yield
    engine.resume("prefill")
    yield
    engine.transfer(rids[2])
    yield
    engine.decode([rids[2]])
    yield
    engine.finish(rids[0])
    yield


def _stats_per_step(config) -> list[dict]:
    engine = Engine(config=config, options=NO_SWEEP)
    out = []
    for _ in _program(engine):
        before = dict(engine.stats)
        touched = set(engine.touched)
        engine.check()
        delta = {k: engine.stats[k] - before[k] for k in before}
        out.append((engine.op, delta, _bound(engine, touched)))
    return out


class TestChecksBoundedByTheStep:
    def test_each_check_costs_at_most_what_the_step_touched(self):
        """Checksum calls and slots checked never exceed the touched requests' own slots."""
        for op, delta, (calls, slots) in _stats_per_step(SMALL):
            assert delta["checksum_calls"] <= calls, op
            assert delta["slots_checked"] <= slots, op
            assert delta["sweeps"] == 0, op

    def test_untouched_live_requests_are_not_rechecked(self):
        """Decoding one of three live requests checksums that request only."""
        engine = Engine(config=SMALL, options=NO_SWEEP)
        rids = [engine.admit(6) for _ in range(3)]
        for rid in rids:
            engine.prefill(rid, 6)
            engine.check()
        before = engine.stats["slots_checked"]
        engine.decode([rids[0]])
        engine.check()
        _, one = _bound(engine, [rids[0]])
        assert engine.stats["slots_checked"] - before == one

    def test_sweeps_come_at_the_configured_interval(self):
        """A full sweep every ``sweep_interval`` steps, and none in between."""
        engine = Engine(config=SMALL, options=EngineOptions(sweep_interval=4))
        steps = 0
        for _ in _program(engine):
            engine.check()
            steps += 1
        assert engine.stats["sweeps"] == engine.step // 4


class TestCostDoesNotGrowWithThePool:
    def test_same_program_same_counts_on_a_million_slots(self):
        """Per step, the million-slot pool checksums exactly what the 64-slot pool does."""
        assert _stats_per_step(LARGE) == _stats_per_step(SMALL)

    def test_no_step_walks_a_free_list(self, monkeypatch):
        """Neither building the engine, nor steps, nor sweeps, nor teardown materialise a free list
        (an O(pool) walk): duplicate checks look only at pages freed so far."""
        walks = []
        original = TokenAllocator.free_pages

        def counting(self):
            walks.append(self.space)
            return original(self)

        monkeypatch.setattr(TokenAllocator, "free_pages", counting)
        engine = Engine(config=LARGE, options=EngineOptions(sweep_interval=1))
        for _ in _program(engine):
            engine.check()
        engine.sweep()
        engine.drain()
        assert walks == []
        assert engine.stats["sweeps"] > 0

    def test_a_fresh_allocator_holds_its_pages_as_a_range(self):
        """Making a million-page allocator stores no per-page list."""
        alloc = TokenAllocator(size=1 << 20)
        assert isinstance(alloc._free, FreeList) and alloc._free.explicit() == []
        assert alloc.available_size() == 1 << 20


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "prefill", "decode", "retract", "resume", "finish",
                                             "transfer", "evict"]), st.integers(0, 7)), max_size=25))
def test_random_programs_check_only_what_they_touch(ops):
    """For any program, each step's check is bounded by the requests that step touched."""
    engine = Engine(config=SMALL, options=NO_SWEEP)
    for op, arg in ops:
        running = engine.live(Phase.RUNNING)
        prefilling = engine.live(Phase.PREFILLING)
        if op == "admit":
            engine.admit(1 + arg)
        elif op == "prefill" and prefilling:
            engine.prefill(prefilling[arg % len(prefilling)].rid, 1 + arg)
        elif op == "decode" and running:
            engine.decode([running[arg % len(running)].rid])
        elif op == "retract" and running:
            engine.retract(running[arg % len(running)].rid)
        elif op == "resume" and engine.retracted["prefill"]:
            engine.resume("prefill")
        elif op == "finish" and running:
            engine.finish(running[arg % len(running)].rid)
        elif op == "transfer" and engine.live(Phase.RUNNING, "prefill"):
            live = engine.live(Phase.RUNNING, "prefill")
            engine.transfer(live[arg % len(live)].rid)
        elif op == "evict" and running:
            engine.evict_swa()
        else:
            continue
        before = dict(engine.stats)
        touched = set(engine.touched)
        engine.check()
        calls, slots = _bound(engine, touched)
        assert engine.stats["checksum_calls"] - before["checksum_calls"] <= calls
        assert engine.stats["slots_checked"] - before["slots_checked"] <= slots


@pytest.mark.parametrize("config", [SMALL, LARGE], ids=["64-slots", "1M-slots"])
def test_engines_build_without_touching_the_pool(config):
    """An engine over a million slots builds like one over 64: lazily zeroed buffers, range free lists."""
    engine = Engine(config=config)
    for fam in engine.families.values():
        for space, alloc in fam.free_lists().items():
            if isinstance(alloc, TokenAllocator):
                assert alloc._free.explicit() == [] or space == "mamba", space


@pytest.mark.parametrize("config", ["swa-ssm", "hybrid-linear-ps4"])
def test_cached_rows_are_the_ledgers_rows(config):
    """The memoised rows and state checksums equal what build_rows and the ledger compute."""
    import torch

    from poolfuzz.harness import row_cache
    from poolfuzz.harness.contents import KIND_KV, KIND_POISON, KIND_STATE
    from poolfuzz.harness.ledger import POISON_CHAIN, Ledger, build_rows

    engine = Engine(config=CONFIGS[config])
    ledger = Ledger()
    for spec in engine.specs.values():
        rows = build_rows(spec, kind=KIND_KV, rid=3, position=torch.arange(2, 9), chain=0, device="cpu")
        assert torch.equal(row_cache.kv_rows(spec, 3, 2, 9, "cpu"), rows)
        poison = build_rows(spec, kind=KIND_POISON, rid=4, position=torch.full((3,), 17), chain=POISON_CHAIN,
                            device="cpu")
        assert torch.equal(row_cache.poison_rows(spec, culprit=4, step=17, n=3, device="cpu"), poison)
        history = ((3, 0, 5), (3, 5, 6))
        chain = ledger.chain(history)
        state = build_rows(spec, kind=KIND_STATE, rid=3, position=6, chain=chain, device="cpu")
        assert torch.equal(row_cache.state_row(spec, 3, 6, chain), state[0])
        assert torch.equal(row_cache.state_rows(spec, 3, 6, torch.tensor([chain]), "cpu"), state)
        assert row_cache.state_checksum(spec, 3, 6, chain) == ledger.state(spec, history)
