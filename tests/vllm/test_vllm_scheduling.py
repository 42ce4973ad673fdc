"""vLLM's own Scheduler on the CPU, fed by the worker stand-in (adapters/vllm/scheduling.py, issue 30).

The scheduler decides everything (chunks, hits, preemption, which blocks); the worker checks, before every
forward, that each position the forward attends to holds the KV of the request's own tokens up to it.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from importlib.metadata import version

from poolfuzz.harness.failures import InvariantViolation, StateLost
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from tests.vllm.judged import PassOverJudged

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


def _fuzz(scheduling, name, stats=None, *, also: tuple[str, ...] = (), **kw):
    """Run the machine on ``name``; ``stats`` gathers the drivers' preemptions and prefix hits."""
    def driver(config):
        d = scheduling.SchedulerDriver(config)
        if stats is not None:
            stats["drivers"].append(d)
        return d

    # fuzzed past the release's judged defects, as CI's newest-release run is: a seed never decides the verdict
    observer = PassOverJudged(version("vllm"), name, also=also)
    run_state_machine_as_test(scheduled_machine(CONFIGS[name], driver_factory=driver, observer=observer),
                              settings=settings(SETTINGS, **kw))


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "swa", "swa-ps4", "hybrid-linear", "swa-ssm-ps4"])
def test_the_real_scheduler_keeps_every_request_on_its_own_kv(scheduling, name):
    stats = {"drivers": []}
    _fuzz(scheduling, name, stats)
    assert len(stats["drivers"]) >= 20
    if not CONFIGS[name].has_mamba:  # mamba mode "none" runs without prefix caching, as vLLM runs it (align: below)
        assert sum(d.hits for d in stats["drivers"]) > 0  # prefix hits happened, and their blocks were checked


def test_memory_pressure_makes_the_scheduler_preempt_and_resume(scheduling):
    stats = {"drivers": []}
    _fuzz(scheduling, "dense-ps4", stats)
    assert sum(d.preempted for d in stats["drivers"]) > 0  # each resumed request was checked at its next forward


def test_a_config_the_scheduler_path_does_not_drive_is_declined_with_its_reason(scheduling, api):
    with pytest.raises(Exception, match="only MHA attention with plain K and V is driven through vLLM.s scheduler"):
        scheduling.SchedulerDriver(CONFIGS["mla"])


def test_a_block_handed_out_twice_is_caught_and_named(scheduling, double_allocation):
    """A block pool that hands out a block a running request still holds (a double allocation): the victim's
    next forward reads the newcomer's KV, and the report names the request, the block and whose data it holds."""
    with pytest.raises(AssertionError) as info:  # StateLost is one
        _fuzz(scheduling, "dense-ps4", phases=[Phase.generate])  # found, not shrunk: each example builds a server
    if isinstance(info.value, StateLost):
        assert re.search(r"req \d+ step \d+: full\.k layer \d+ position \d+: block \d+ slot \d+ holds (req \d+'s "
                         r"position \d+|the KV of a draft token req \d+ proposed at position \d+)", str(info.value)), info.value
    elif isinstance(info.value, InvariantViolation):  # the KV-event mirror saw the doubled block's events first
        assert re.search(r"the KV events (remove|store) hash \d+ of group \d+", str(info.value)), info.value
    else:  # vLLM's own guard saw the doubled block first (0.23's cache_full_blocks asserts a block is cached once)
        assert info.traceback[-1].path.name == "block_pool.py", info.value


def test_a_recurrent_state_lost_between_two_chunks_is_caught(scheduling):
    """Mamba mode "none": a chunked prefill's second chunk must start from the state of exactly the first chunk's
    tokens; a state block cleared in between (as a stray zeroing would) is named, with the block and what it holds."""
    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SchedulerDriver(CONFIGS["hybrid-linear"])
    rid = driver.add_request(length=20, share=0, max_tokens=2)
    driver.step()  # the token budget ends the prefill early: a chunk, then the rest
    request = driver.scheduler.requests[rid]
    assert 0 < request.num_computed_tokens < 20
    mamba = next(g for g in driver.built.groups if g.space == "mamba")
    block = driver.worker.tables[rid][mamba.index][-1]
    for (group, _layer), state in driver.worker.state.items():
        if group == mamba.index:
            state.tensor[block] = 0
    with pytest.raises(LostKv, match=rf"req {rid} step 2: mamba\.state layer \d+ position {request.num_computed_tokens - 1}: "
                                     rf"block {block} slot {block} holds zeros"):
        driver.step()


# --- mamba cache mode "align" (prefix caching for hybrid models), anchored on vllm-project/vllm#33706 -----------
# Before 0.17.0 the scheduler split a prefill block-aligned only while a request had no output tokens
# (``Scheduler._mamba_block_aligned_split``: ``if request.num_output_tokens == 0``), so a request resumed after
# preemption re-prefilled in chunks that end inside a block; the worker writes the state at a chunk's end, and the
# block is cached holding the state of fewer tokens than its hash covers. 0.16.0 also lets a request take a prefix
# hit on a state block another request computes in the same step (0.17.0's ``MambaManager.cached_blocks_this_step``
# defers it). Both are decided by version: 0.17.0 has both fixes.
ALIGN = "hybrid-extra-buffer-ps4"  # the issue's #33706 config: pages of 4, mamba cache mode align
STATE_LOST = (r"req (?P<rid>\d+) step \d+: mamba\.state layer \d+ position (?P<pos>\d+): block (?P<block>\d+) "
              r"slot \d+ holds (?P<whose>.+) \(expected")


@pytest.fixture(scope="module")
def align_fixed(scheduling, api) -> bool:
    """Whether this release carries the #33706 fix (0.17.0 on)."""
    if "align" not in api.mamba_cache_modes:
        pytest.skip(f"vLLM {api.version} has no mamba cache mode align")
    major, minor = (int(x) for x in api.version.split(".")[:2])
    return (major, minor) >= (0, 17)


@pytest.mark.anchored
@pytest.mark.parametrize("name", ["hybrid-extra-buffer", ALIGN])
def test_mamba_align_resumes_every_request_from_its_own_state(scheduling, align_fixed, name):
    """The scheduler splits prefills block-aligned and caches state blocks; the worker moves and writes the states
    where the GPU model runner does. Every forward, a prefix hit's first included, must continue from the state of
    exactly the tokens vLLM says are computed."""
    stats = {"drivers": []}
    if not align_fixed:  # 0.16.0: a stale or misaligned state is found, and the report says whose it is
        # 0.16.0: found after 8 derandomized examples on pages of 4 and 297 on pages of 1 (alone, at 8a53793's
        # successor); the draws shift with the literals of every loaded module, so the budget keeps a wide margin.
        with pytest.raises(StateLost, match=STATE_LOST):
            _fuzz(scheduling, name, stats, phases=[Phase.generate], max_examples=800)
        return
    _fuzz(scheduling, name, stats)
    assert len(stats["drivers"]) >= 20
    assert sum(d.hits for d in stats["drivers"]) > 0  # hits resumed from cached state blocks, checked
    if name == ALIGN:
        assert sum(d.preempted for d in stats["drivers"]) > 0  # resumed requests re-prefilled, checked


def _run_until_finished(driver, rid: str, steps: int = 80) -> None:
    for _ in range(steps):
        if rid not in driver.scheduler.requests:
            return
        driver.step()
    raise AssertionError(f"req {rid} did not finish in {steps} steps")


@pytest.mark.anchored
def test_33706_a_resumed_prefill_caches_a_state_off_its_block_boundary(scheduling, align_fixed):
    """vllm-project/vllm#33706 by hand. A long request B crowds out A (12 prompt tokens) until A is preempted with
    an output token and its cached blocks are evicted; A resumes and re-prefills its 13 tokens. 0.16.0 does not
    split a resumed request block-aligned: a chunk of 9 (the token budget), then the rest, so A's block of tokens
    8..11 is cached holding the state after 9 tokens. C shares A's first 12 tokens; its prefix hit of 12 resumes
    from that block. 0.17.0 on splits 8, 4, 1, and C continues from the state of exactly its hit."""
    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SchedulerDriver(CONFIGS[ALIGN])
    b = driver.add_request(length=60, share=0, max_tokens=16)
    a = driver.add_request(length=12, share=0, max_tokens=4)
    _run_until_finished(driver, b)
    assert driver.preempted > 0
    _run_until_finished(driver, a)
    c = driver.add_request(length=2, share=3, max_tokens=2)  # A's first 12 tokens, then 2 of its own
    assert driver.worker.tokens[c].ids[:12] == driver.worker.tokens[a].ids[:12]
    if not align_fixed:
        with pytest.raises(LostKv) as info:
            driver.step()
        found = re.match(STATE_LOST, str(info.value))
        assert found, info.value
        assert found["rid"] == c and found["pos"] == "11"
        assert found["whose"] == f"the state after 9 tokens, not 12: its own first 9, written by req {a}", info.value
        return
    hits = driver.hits
    _run_until_finished(driver, c)
    assert driver.hits == hits + 1  # C resumed from a cached state block (12 tokens; 8 where 0.34 keeps every other)
    assert driver.drain() is None


def test_the_server_is_one_vllm_would_start_and_refuses_what_its_front_end_refuses(scheduling):
    """swa-ssm-ps4's 16 usable blocks hold one request of 40 tokens (full 10 pages, window 5, mamba 1), not the 76 the
    layout allows: a server with max_model_len 76 would not start, and its scheduler, reserving the whole prompt,
    never admitted a 33-token prompt (a false 'still unfinished' verdict). A prompt of max_model_len or more is
    refused before the scheduler, as vLLM's front end refuses it; a shorter one runs to its end."""
    driver = scheduling.SchedulerDriver(CONFIGS["swa-ssm-ps4"])
    limit = driver.built.max_model_len
    assert limit == 40
    assert driver.scheduler.max_model_len == limit  # the server was built with it
    refused = driver.add_request(length=limit, share=0, max_tokens=1)
    assert refused.startswith("refused") and driver.refused == 1 and not driver.live()
    assert f"(length {limit})" in refused, refused  # vLLM's own words (0.17.0 on), or the rule as 0.16.0 has it
    rid = driver.add_request(length=limit - 1, share=0, max_tokens=4)
    assert driver.live() == [rid]
    assert driver.drain() is None  # admitted, run to its end (capped at max_model_len), nothing held


# --- speculative decoding: the scheduler verifies the worker's drafts and rolls back the rejected ones --------
def test_drafts_are_verified_and_the_rejected_ones_recomputed_on_the_requests_own_kv(scheduling):
    stats = {"drivers": []}
    _fuzz(scheduling, "dense-ps4", stats)
    drivers = stats["drivers"]
    assert all(d.built.spec_tokens == scheduling.SPEC_TOKENS for d in drivers)
    verified = sum(d.worker.drafts_verified for d in drivers)
    accepted = sum(d.worker.drafts_accepted for d in drivers)
    assert 0 < accepted < verified  # some drafts accepted, some rejected: both paths ran and were checked


def test_a_mamba_server_runs_without_drafts(scheduling):
    assert scheduling.SchedulerDriver(CONFIGS["hybrid-linear"]).built.spec_tokens == 0


@pytest.fixture
def no_rollback(scheduling, monkeypatch):
    """Plant a missing rollback in vLLM's Scheduler: after ``update_from_output`` a request keeps the
    ``num_computed_tokens`` of every draft it was scheduled with, rejected ones included."""
    Scheduler = scheduling.scheduler_modules().Scheduler
    real = Scheduler.update_from_output

    def forgetting(self, out, model_output):
        kept = {rid: self.requests[rid].num_computed_tokens for rid in out.scheduled_spec_decode_tokens
                if rid in self.requests}
        result = real(self, out, model_output)
        for rid, computed in kept.items():
            request = self.requests.get(rid)
            if request is not None and computed <= request.num_tokens:
                request.num_computed_tokens = computed
        return result

    monkeypatch.setattr(Scheduler, "update_from_output", forgetting)


def test_a_rejected_draft_left_counted_as_computed_is_caught_and_named(scheduling, no_rollback):
    """The request's next forward attends a position that holds its rejected draft's KV: the report names it. (The
    planted fault's other symptom, a request whose counted drafts never let it finish, is passed over, so which one a
    seed meets first does not decide the test.)"""
    with pytest.raises(StateLost, match=r"req \d+ step \d+: full\.k layer \d+ position \d+: block \d+ slot \d+ holds "
                                        r"the KV of a draft token req \d+ proposed at position \d+ \(rejected\)"):
        _fuzz(scheduling, "dense-ps4", phases=[Phase.generate], also=("InvariantViolation:stuck:-",))


# --- KV events: what the server publishes, replayed as a router replays it, against its prefix cache -----------
def _events_driver(scheduling, api):
    driver = scheduling.SchedulerDriver(CONFIGS["dense-ps4"])
    if driver.events is None:
        pytest.skip(f"vLLM {api.version} publishes no group in its KV events")
    return driver


def test_the_published_events_match_the_prefix_cache(scheduling, api):
    driver = _events_driver(scheduling, api)
    driver.add_request(length=13, share=0, max_tokens=2)
    for _ in range(6):
        driver.step()
    assert sum(driver.events.cached.values()) >= 3  # the request's full blocks were stored, and published
    assert driver.state_problem() is None


def test_a_block_cached_without_its_event_is_caught_by_the_machine(scheduling, api, monkeypatch):
    """A BlockStored lost on its way out (the pool caches the block but its event is dropped): the router's view
    and the prefix cache disagree, and the machine's check after the step says under which hash."""
    _events_driver(scheduling, api)
    from vllm.v1.core.block_pool import BlockPool

    real = BlockPool.cache_full_blocks

    def dropping(self, *args, **kwargs):
        before = len(self.kv_event_queue)
        result = real(self, *args, **kwargs)
        del self.kv_event_queue[before:]
        return result

    monkeypatch.setattr(BlockPool, "cache_full_blocks", dropping)
    with pytest.raises(AssertionError, match=r"the prefix cache holds \d+ block\(s\) under hash \w+ of group 0, but "
                                             r"the KV events say 0"):
        _fuzz(scheduling, "dense-ps4", phases=[Phase.generate])


# --- a KV connector to an external store (connector.py): vLLM's scheduler decides what loads and saves --------
def test_the_store_saves_finished_requests_and_loads_them_into_new_blocks(scheduling, api):
    stats = {"drivers": []}
    _fuzz(scheduling, "dense-ps4", stats)
    drivers = stats["drivers"]
    if all(d.connector is None for d in drivers):
        pytest.skip(f"vLLM {api.version} has no KV connector config to name the store's connector by")
    assert sum(d.connector.saved for d in drivers) > 0
    assert sum(d.connector.loaded for d in drivers) > 0  # loads happened, and their blocks were checked


@pytest.mark.parametrize("name", ["swa-ps4", "hybrid-extra-buffer-ps4"])
def test_the_store_serves_hybrid_models_through_the_schedulers_own_hybrid_hit_handling(scheduling, api, name):
    """On a hybrid model the connector takes every group's blocks (``SupportsHMA``): loads happen, and each loaded
    request's sliding-window KV and recurrent state are checked at its forward."""
    if "align" not in api.mamba_cache_modes and CONFIGS[name].has_mamba:
        pytest.skip(f"vLLM {api.version} has no mamba cache mode align")
    stats = {"drivers": []}
    _fuzz(scheduling, name, stats)
    drivers = stats["drivers"]
    if all(d.connector is None for d in drivers):
        pytest.skip(f"vLLM {api.version}'s scheduler does not handle a connector's hybrid hits (connector.hybrid_capable)")
    assert sum(d.connector.loaded for d in drivers) > 0


def test_a_store_that_returns_another_requests_kv_is_caught_at_the_loading_forward(scheduling, api):
    """A transfer that delivers wrong data (a corrupt store entry): the request that loads it attends the block,
    and the report names the position and whose KV it holds."""
    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SchedulerDriver(CONFIGS["dense-ps4"])
    if driver.connector is None:
        pytest.skip(f"vLLM {api.version} has no KV connector config to name the store's connector by")
    first = driver.add_request(length=9, share=0, max_tokens=1)
    for _ in range(6):
        driver.step()
    assert driver.connector.saved >= 2 and first not in driver.scheduler.requests
    store = driver.worker.store
    one, two = sorted(store.values, key=len)[:2]
    store.values[two] = store.values[one]  # the second block's entry holds the first block's values
    assert driver.scheduler.reset_prefix_cache()  # no local hit: the next request's prefix comes from the store
    second = driver.add_request(length=2, share=2, max_tokens=1)
    with pytest.raises(LostKv, match=rf"req {second} step \d+: full\.[kv] layer \d+ position 4: block \d+ slot \d+ "
                                     rf"holds req {first}'s position 0"):
        for _ in range(4):
            driver.step()
