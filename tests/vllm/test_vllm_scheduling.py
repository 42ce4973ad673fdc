"""vLLM's own Scheduler on the CPU, fed by the worker stand-in (adapters/vllm/scheduling.py, issue 30).

The scheduler decides everything (chunks, hits, preemption, which blocks); the worker checks, before every
forward, that each position the forward attends to holds the KV of the request's own tokens up to it.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def scheduling(api):
    from poolfuzz.adapters.vllm import scheduling

    reason = scheduling.release_problem(api)
    if reason:
        pytest.skip(reason)
    return scheduling


def _fuzz(scheduling, name, stats=None, **kw):
    """Run the machine on ``name``; ``stats`` gathers the drivers' preemptions and prefix hits."""
    def driver(config):
        d = scheduling.SchedulerDriver(config)
        if stats is not None:
            stats["drivers"].append(d)
        return d

    run_state_machine_as_test(scheduled_machine(CONFIGS[name], driver_factory=driver), settings=settings(SETTINGS, **kw))


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "swa", "swa-ps4", "hybrid-linear", "swa-ssm-ps4"])
def test_the_real_scheduler_keeps_every_request_on_its_own_kv(scheduling, name):
    stats = {"drivers": []}
    _fuzz(scheduling, name, stats)
    assert len(stats["drivers"]) >= 20
    if not CONFIGS[name].has_mamba:  # mamba mode "none" runs without prefix caching, as vLLM runs it
        assert sum(d.hits for d in stats["drivers"]) > 0  # prefix hits happened, and their blocks were checked


def test_memory_pressure_makes_the_scheduler_preempt_and_resume(scheduling):
    stats = {"drivers": []}
    _fuzz(scheduling, "dense-ps4", stats)
    assert sum(d.preempted for d in stats["drivers"]) > 0  # each resumed request was checked at its next forward


def test_a_config_the_scheduler_path_does_not_drive_is_declined_with_its_reason(scheduling, api):
    with pytest.raises(Exception, match='mamba cache mode align .* is not driven through vLLM.s scheduler yet'):
        scheduling.SchedulerDriver(CONFIGS["hybrid-extra-buffer"])


def test_a_block_handed_out_twice_is_caught_and_named(scheduling, monkeypatch):
    """A block pool that hands out a block a running request still holds (a double allocation): the victim's
    next forward reads the newcomer's KV, and the report names the request, the block and whose data it holds."""
    from vllm.v1.core.block_pool import BlockPool

    real = BlockPool.get_new_blocks

    def double_allocating(self, num_blocks, *args, **kwargs):
        blocks = real(self, num_blocks, *args, **kwargs)
        # a block a request is still filling (no hash yet: vLLM's own caching assert would catch a cached one)
        held = [b for b in self.blocks if b.ref_cnt == 1 and not b.is_null and b.block_hash is None and b not in blocks]
        if held and blocks:
            blocks[0].ref_cnt -= 1
            self.free_block_queue.append(blocks[0])
            held[0].ref_cnt += 1
            blocks[0] = held[0]
        return blocks

    monkeypatch.setattr(BlockPool, "get_new_blocks", double_allocating)
    with pytest.raises(AssertionError) as info:  # StateLost is one
        _fuzz(scheduling, "dense-ps4", phases=[Phase.generate])  # found, not shrunk: each example builds a server
    if isinstance(info.value, StateLost):
        assert re.search(r"req \d+ step \d+: full\.k layer \d+ position \d+: block \d+ slot \d+ holds req \d+'s "
                         r"position \d+", str(info.value)), info.value
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
