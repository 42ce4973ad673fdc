"""Speculative decoding through SGLang's own scheduler (``adapters/sglang/scheduler/spec_worker.py``, issue 31): the
spec-v2 allocation, verify window, mamba commit, commit of the accepted tokens and release of the over-allocated
slots are SGLang's; the target and draft models are stood in for."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import LostKv

SPEC = "hybrid-spec"  # a Qwen3-Next-like model (full attention and mamba layers), 4 tokens verified a round


@pytest.fixture
def spec_driver(scheduling):
    from poolfuzz.adapters.sglang.scheduler.spec_worker import speculative_problem

    reason = speculative_problem(CONFIGS[SPEC])
    if reason:
        pytest.skip(reason)
    return lambda: scheduling.SglangSchedulerDriver(CONFIGS[SPEC])


def _serve(driver, requests, steps=80):
    rids = [driver.add_request(length=length, share=share, max_tokens=max_tokens)
            for length, share, max_tokens in requests]
    reqs = [driver.requests[rid] for rid in rids]
    for _ in range(steps):
        driver.step()
        assert driver.state_problem() is None
    return rids, reqs


def test_verify_rounds_accept_and_reject_drafts_and_free_what_they_over_allocated(spec_driver):
    """Three requests on a 48-slot pool: every round SGLang tops each request's slots up to twice the round's draft
    allocation past what it committed, the worker verifies the drafter's tree on them, and SGLang commits the accepted
    tokens and the accepted node's recurrent state. The memory pressure makes the server retract; at the end every request
    has its tokens, and SGLang's own idle leak checks find every over-allocated slot returned."""
    driver = spec_driver()
    rids, reqs = _serve(driver, [(5, 0, 6), (8, 1, 7), (11, 0, 8)])
    worker = driver.spec_worker
    assert worker.rounds > 0
    assert 0 < worker.drafts_accepted < worker.drafts_verified  # both accepted and rejected drafts were verified
    assert driver.retracted >= 1
    for req in reqs:  # finished at its length: SGLang caps the over-accepted tokens of the last round
        assert type(req.finished_reason).__name__ == "FINISH_LENGTH", req
        assert req.kv.kv_allocated_len == 0  # released, over-allocation included
    assert not set(rids) & driver.aborted
    assert driver.drain() is None


def test_a_commit_of_the_last_drafted_node_is_caught_as_a_rejected_drafts_state(spec_driver, monkeypatch):
    """The check can fail: a commit that takes the state after the last drafted node, whether it was accepted or
    not, leaves the next round's request on the state of a draft the target rejected, and the failure says so."""
    from poolfuzz.adapters.sglang import compat

    real = compat.spec_v2_modules

    def last_step_committed():
        m = real()
        commit = m.commit_mamba_states_after_verify

        def wrong(target, batch, accept_lens, accept_index, draft_tokens):
            bs = len(accept_lens)
            last = accept_index.new_tensor([[i * draft_tokens + draft_tokens - 1] for i in range(bs)])
            commit(target, batch, accept_lens.new_ones((bs,)), last, draft_tokens)

        m.commit_mamba_states_after_verify = wrong
        return m

    monkeypatch.setattr(compat, "spec_v2_modules", last_step_committed)
    driver = spec_driver()
    with pytest.raises(LostKv) as caught:
        _serve(driver, [(5, 0, 8), (8, 0, 8)])
    assert caught.value.component.startswith("mamba.")
    assert "a rejected draft" in caught.value.whose


def test_an_accepted_path_off_the_windows_front_is_moved_there_by_sglang(spec_driver, monkeypatch):
    """A draft tree's accepted path that is not the front of the verify window: SGLang's
    ``_finalize_accept_tree_path`` moves its KV there (``move_kv_cache``) and the request reads its own KV next round;
    with the move taken out, it reads a rejected draft's, and the failure says so."""
    import sglang.srt.speculative.eagle_worker_common as verify_module

    traffic = [(5, 0, 8), (8, 1, 8), (11, 0, 8)]
    driver = spec_driver()
    _serve(driver, traffic, steps=60)
    assert driver.spec_worker.paths_moved > 0 and driver.drain() is None
    monkeypatch.setattr(verify_module, "move_accept_tokens_to_target_kvcache", lambda *args, **kwargs: None)
    with pytest.raises(LostKv) as caught:
        _serve(spec_driver(), traffic, steps=60)
    assert caught.value.component.startswith("full.") and "a rejected draft" in caught.value.whose


def test_sglangs_acceptance_kernel_is_checked_against_the_targets_tokens(spec_driver, monkeypatch):
    """The accepted nodes are what SGLang's ``verify_tree_greedy`` kernel answers on the drafted trees; a kernel that
    accepts no draft where the target agreed with one is caught, naming both answers."""
    from poolfuzz.adapters.sglang import compat

    real = compat.spec_v2_modules

    def root_only():
        m = real()

        def accept_nothing(predicts, accept_index, accept_token_num, candidates, *trees, target_predict):
            roots = torch.arange(len(candidates)) * candidates.shape[1]
            accept_index[:, 0] = roots.to(accept_index.dtype)
            predicts[roots] = target_predict[:, 0].to(predicts.dtype)  # the target's token after the root only
            accept_token_num.zero_()

        m.verify_tree_greedy = accept_nothing
        return m

    monkeypatch.setattr(compat, "spec_v2_modules", root_only)
    with pytest.raises(AssertionError, match=r"verify_tree_greedy accepted nodes \[\[\d+\]"):
        _serve(spec_driver(), [(5, 0, 8), (8, 1, 8), (11, 0, 8)], steps=60)


def test_the_fuzzer_drives_speculative_servers(spec_driver, scheduling):
    """The scheduled machine over the speculative server: random traffic, aborts and flushes, every round checked."""
    drivers = []

    def driver(config):
        d = scheduling.SglangSchedulerDriver(config)
        drivers.append(d)
        return d

    run_state_machine_as_test(scheduled_machine(CONFIGS[SPEC], driver_factory=driver),
                              settings=settings(max_examples=12, stateful_step_count=25, deadline=None,
                                                derandomize=True, suppress_health_check=list(HealthCheck),
                                                database=None))
    assert sum(d.spec_worker.rounds for d in drivers) > 20
    assert sum(d.spec_worker.drafts_accepted for d in drivers) > 0
    assert sum(d.spec_worker.paths_moved for d in drivers) > 0


def test_servers_that_do_not_drive_speculation_decline_it_saying_which_does(scheduling):
    from poolfuzz.adapters.sglang.scheduler.decode_server import SglangDecodeDriver
    from poolfuzz.adapters.sglang.scheduler.hicache_server import SglangHiCacheDriver
    from poolfuzz.adapters.sglang.scheduler.spec_worker import speculative_problem

    for cls in (SglangDecodeDriver, SglangHiCacheDriver):
        assert "sglang:scheduler does" in speculative_problem(CONFIGS[SPEC], cls)
    assert speculative_problem(CONFIGS["hybrid-linear"], SglangDecodeDriver) is None  # only speculative configs


def test_without_the_real_triton_the_speculative_server_is_declined_with_the_fix(scheduling, monkeypatch):
    from poolfuzz.adapters.sglang import shims
    from poolfuzz.adapters.sglang.scheduler import spec_worker

    monkeypatch.setattr(shims, "install", lambda: {"triton": "stand-in"})
    reason = spec_worker.speculative_problem(CONFIGS[SPEC])
    if reason and "spec-v2" in reason:
        pytest.skip(reason)  # a release without the synchronous spec-v2 branch says so first
    assert "install the real triton wheel" in reason


def _edge_of_context(driver):
    """A 3-token request (row 5: rows are handed out from the last), then one of 25 tokens, the longest prompt the
    32-token context admits (row 4): its second verify round runs with 27 tokens committed."""
    first = driver.add_request(length=3, share=0, max_tokens=8)
    driver.step()
    driver.add_request(length=25, share=0, max_tokens=5)
    for _ in range(30):
        driver.step()
    return first


@pytest.mark.anchored
def test_a_draft_trees_reserve_at_the_context_boundary_overruns_the_request_row(spec_driver, scheduling, monkeypatch):
    """SGLang 0.5.23, spec v2 on one-token pages, here a draft tree (top-k 2; docs/bugs/sglang-spec-v2-row-overflow.md):
    each round tops a request's KV up to 16 slots past what it committed, but its request row has 9 columns past the
    context (``get_req_to_token_extra_context_len`` sizes the row for the reserve only at page_size > 1). The
    25-token request's second round writes its allocation past its row, over the first positions of the next row,
    the 3-token request's: caught by name; without the row check, that request's next forward reads another's slot
    (silent state loss); with the row sized for the reserve at every page size (what sglang#33581 proposes for the
    DFLASH family), the same traffic passes."""
    import sglang.srt.mem_cache.allocation_sizing as sizing

    from poolfuzz.adapters.sglang.scheduler import spec_worker
    from poolfuzz.pools.errors import RowOverflow

    # hybrid-spec-long (the config the fuzzer finds it on) with a pool roomy enough for a bystander to keep decoding
    # beside the long request, so the write past the row lands on a live request's positions
    long_spec = CONFIGS["hybrid-spec-long"].replace(full_tokens=64)
    with pytest.raises(RowOverflow) as caught:
        _edge_of_context(scheduling.SglangSchedulerDriver(long_spec))
    assert "req 000002: SGLang allocated 43 KV slots" in str(caught.value)
    assert "request row of 41" in str(caught.value) and "row 5's positions 0..1 (req 000001's)" in str(caught.value)

    with monkeypatch.context() as unchecked:  # the engine alone: the bystander decodes on someone else's slot
        unchecked.setattr(spec_worker.SpecWorker, "_check_rows", lambda self, batch: None)
        with pytest.raises(LostKv) as lost:
            _edge_of_context(scheduling.SglangSchedulerDriver(long_spec))
    assert (lost.value.rid, lost.value.position, lost.value.component) == ("000001", 0, "full.k")

    import sglang.srt.mem_cache.kv_cache_configurator as configurator_module

    real = sizing.get_req_to_token_extra_context_len

    def reserve_sized():
        return max(real(), sizing.get_alloc_reserve_per_decode() + sizing.get_alloc_page_size() - 1)

    # read where SGLang's configurator sizes the rows of the pools the server runs on, and where the scheduler reads it
    monkeypatch.setattr(sizing, "get_req_to_token_extra_context_len", reserve_sized)
    monkeypatch.setattr(configurator_module, "get_req_to_token_extra_context_len", reserve_sized)
    driver = scheduling.SglangSchedulerDriver(long_spec)
    _edge_of_context(driver)
    assert driver.family.sg_req_pool.req_to_token.shape[1] == 32 + 16
    assert driver.drain() is None
