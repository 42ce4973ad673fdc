"""Forks through SGLang's own prefix tree (adapters/sglang/tree/trees.py), on the installed release."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError


@pytest.fixture
def tree_api(api):
    from poolfuzz.adapters.sglang.tree.trees import tree_problem

    problem = tree_problem(api, CONFIGS["dense"])
    if problem:
        pytest.skip(f"this release's tree is not driven: {problem}")
    return api


def _engine(name: str):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine

    return Engine(config=CONFIGS[name], family_factory=build_family)


def _forked(e):
    """admit 6, prefill, decode, then fork with 3 tokens of its own: (source rid, fork rid)."""
    src = e.admit(6)
    e.check()
    e.prefill(src, 8)
    e.check()
    e.decode([src])
    e.check()
    dst = e.fork(src, 3)
    e.check()
    return src, dst


@pytest.mark.parametrize("name", ["dense", "dense-ps4"])
def test_fork_is_a_radix_hit_on_the_tree_the_registry_builds(tree_api, name):
    from sglang.srt.mem_cache import registry  # noqa: F401 (the release builds its tree there)

    e = _engine(name)
    fam = e.families["prefill"]
    assert fam.supports_fork is True
    # 0.5.23's scheduler builds a UnifiedRadixCache for every model (RadixCache only for pure SWA)
    assert type(fam.tree).__name__ == "UnifiedRadixCache"
    src, dst = _forked(e)
    ps = CONFIGS[name].page_size
    src_kv, dst_kv = e.requests[src].kv, e.requests[dst].kv
    # the source's prompt (6 tokens) was checkpointed after its prefill: that, page-aligned, is the hit
    assert dst_kv.cache_protected_len == 6 // ps * ps
    hit = dst_kv.cache_protected_len
    shared = fam.sg_req_pool.req_to_token[dst_kv.req_pool_idx, :hit]
    assert torch.equal(shared, fam.sg_req_pool.req_to_token[src_kv.req_pool_idx, :hit])  # the same slots
    e.prefill(dst, 8)
    e.check()
    e.finish(src)
    e.check()
    e.finish(dst)
    e.check()
    held, evictable = fam.tree_sizes()
    assert held == evictable > 0  # every request ended: the tree keeps its nodes, all unlocked
    e.sweep()
    e.drain()  # the flush evicts them all: every pool is whole again


def test_a_locked_prefix_freed_under_a_fork_is_caught(tree_api):
    e = _engine("dense")
    fam = e.families["prefill"]
    src, dst = _forked(e)
    hit = e.requests[dst].kv.cache_protected_len
    slots = fam.sg_req_pool.req_to_token[e.requests[dst].kv.req_pool_idx, :hit].to(torch.int64)
    fam.sg_allocator.free(slots)  # what an eviction that ignores the lock would leave behind
    fam.notify_frees()
    with pytest.raises(PoolfuzzFailure, match="free list"):
        e.check()


def test_configs_the_tree_path_does_not_drive_say_why(tree_api):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.tree.trees import tree_problem

    from poolfuzz.adapters.sglang.lifecycle.family import unsupported_reason

    for name in ("hybrid-linear-ps4", "hybrid-extra-buffer", "swa-ssm-ps4"):  # SGLang's MambaComponent
        assert "page size 1 without the extra buffer" in tree_problem(tree_api, CONFIGS[name])
        if unsupported_reason(CONFIGS[name]):  # a server SGLang refuses outright (0.5.22 on: hybrid-linear-ps4)
            continue
        assert build_family(CONFIGS[name]).supports_fork is False


def test_fuzzing_dense_with_forks_passes(tree_api, fuzz):
    outcome = fuzz(CONFIGS["dense"], examples=15)
    assert outcome.failure is None, outcome.failure


def test_sglangs_python_tree_core_runs_the_same_fork(tree_api, monkeypatch):
    """SGLang's own switch selects its Python TreeCore (the Rust one is the default): the same program passes."""
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    e = _engine("dense-ps4")
    fam = e.families["prefill"]
    assert "rust" not in type(fam.tree.tree_core).__module__
    src, dst = _forked(e)
    assert e.requests[dst].kv.cache_protected_len == 4
    e.finish(src)
    e.check()
    e.sweep()
    e.drain()


def _mamba_fork(e, *, decode_first: bool):
    src = e.admit(6)
    e.check()
    e.prefill(src, 8)
    e.check()
    if decode_first:  # the tree's checkpoint is the prompt's: the decoded token is computed again
        e.decode([src])
        e.check()
    dst = e.fork(src, 3)
    e.check()
    return src, dst


@pytest.mark.parametrize("decode_first", [False, True])
def test_a_mamba_fork_copies_the_trees_checkpoint_into_its_own_slot(tree_api, decode_first):
    e = _engine("hybrid-linear")
    fam = e.families["prefill"]
    assert fam.supports_fork is True and fam.tree.supports_mamba()
    # the configurator's rule for a mamba radix tree: 3 state slots a running request
    assert fam.config.mamba_slots == 3 * CONFIGS["hybrid-linear"].request_rows
    src, dst = _mamba_fork(e, decode_first=decode_first)
    kv = e.requests[dst].kv
    assert kv.cache_protected_len == 6  # the prompt's checkpoint, full KV and state
    sg = fam.protocol.standin(kv, fam)
    assert sg.kv.mamba_cow_src_index is None if decode_first else sg.kv.mamba_cow_src_index is not None
    assert kv.mamba_pool_idx not in fam.cached_units()["mamba"]  # a slot of its own, not the tree's
    e.prefill(dst, 8)
    e.check()
    e.decode([src, dst])
    e.check()
    e.finish(src)
    e.check()
    e.finish(dst)
    e.check()
    held, evictable = fam.tree_mamba()
    assert held == evictable > 0  # the finished requests' states were donated to the tree, unlocked
    e.sweep()
    e.drain()


@pytest.mark.parametrize("decode_first", [False, True])
def test_a_copy_on_write_that_never_copies_is_caught(tree_api, decode_first):
    e = _engine("hybrid-linear")
    fam = e.families["prefill"]
    fam.sg_req_pool.copy_mamba_state = lambda src, dst: None  # the slot keeps what it had
    with pytest.raises(PoolfuzzFailure, match="StateLost.*mamba"):
        src, dst = _mamba_fork(e, decode_first=decode_first)
        e.prefill(dst, 8)
        e.check()


def test_fuzzing_hybrid_linear_with_forks_passes(tree_api, fuzz):
    outcome = fuzz(CONFIGS["hybrid-linear"], examples=15)
    assert outcome.failure is None, outcome.failure


@pytest.mark.parametrize("name", ["swa", "swa-ps4", "swa-ssm"])
def test_a_swa_fork_shares_a_prefix_whose_early_window_the_tree_tombstoned(tree_api, name):
    """A prompt longer than the window: the checkpoint after its prefill frees the SWA that slid out
    (``free_out_of_window_slots``), so the tree's prefix is a tombstone before the window and live in
    it. The fork matches it (the SWA validator needs only the window), locks it, and decodes on."""
    e = _engine(name)
    fam = e.families["prefill"]
    assert fam.supports_fork is True and fam.tree.supports_swa()
    window = CONFIGS[name].sliding_window
    src = e.admit(3 * window)
    e.check()
    e.prefill(src, 3 * window)
    e.check()
    assert e.requests[src].kv.swa_evicted_seqlen > 0  # the checkpoint freed what slid out
    dst = e.fork(src, 2)
    e.check()
    kv = e.requests[dst].kv
    assert kv.cache_protected_len > window and kv.swa_evicted_seqlen == 0
    e.prefill(dst, 8)
    e.check()
    e.decode([src, dst])
    e.check()
    e.finish(dst)
    e.check()
    e.sweep()
    e.drain()


@pytest.mark.parametrize("name", ["swa-ps4", "swa-ssm"])
def test_fuzzing_swa_with_forks_passes(tree_api, fuzz, name):
    outcome = fuzz(CONFIGS[name], examples=15)
    assert outcome.failure is None, outcome.failure


@pytest.mark.parametrize("interval", ["1", None])
def test_decode_time_window_eviction_through_the_tree_passes(tree_api, fuzz, monkeypatch, interval):
    """SGLang's SGLANG_SWA_EVICTION_INTERVAL at 1 (every decode past the window evicts through
    tree_cache.evict_sliding_windows), and unset: the adapter's default, one window (``eviction_interval``:
    SGLang's own 128 would never evict in these contexts)."""
    from poolfuzz.adapters.sglang.tree import tree_swa

    if interval is None:
        monkeypatch.delenv("SGLANG_SWA_EVICTION_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", interval)
    moved = []
    real = tree_swa.evict_window

    def counted(family, sg, pre_len):
        before = tree_swa.frontier(family, sg)
        real(family, sg, pre_len)
        moved.append(tree_swa.frontier(family, sg) > before)

    monkeypatch.setattr(tree_swa, "evict_window", counted)
    outcome = fuzz(CONFIGS["swa-ps4"], examples=15)
    assert outcome.failure is None, outcome.failure
    assert any(moved)


def test_the_eviction_interval_is_one_window_unless_the_environment_sets_it(tree_api, monkeypatch):
    from poolfuzz.adapters.sglang.pools import environment

    fam = _engine("swa-ps4").families["prefill"]
    monkeypatch.delenv("SGLANG_SWA_EVICTION_INTERVAL", raising=False)
    assert environment.eviction_interval(fam.config) == CONFIGS["swa-ps4"].sliding_window
    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "128")
    assert environment.eviction_interval(fam.config) == 128
    monkeypatch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "often")
    with pytest.raises(ConfigError, match="SGLANG_SWA_EVICTION_INTERVAL='often' is not a number of tokens"):
        environment.eviction_interval(fam.config)


def test_a_fork_whose_hit_is_all_the_tree_could_evict_waits(tree_api):
    """The tree holds the source's old checkpoint (retracted, resumed) as its only evictable pages; the fork
    matches and locks them, so nothing is left to evict for the rest: SGLang runs out, and the reference
    model must say so too (it once counted the locked hit as evictable: a false outcome mismatch)."""
    e = _engine("dense-ps4")
    e.admit(5)
    e.prefill(1, 5)
    e.admit(15)
    e.prefill(2, 15)
    e.decode_speculative(1, draft=3, accepted=3)
    e.retract(2)
    e.resume("prefill")
    e.decode([2])
    e.decode([2])
    e.check()
    held, evictable = e.families["prefill"].tree_sizes()
    assert evictable == 12 and e.families["prefill"].sg_allocator.available_size() == 4
    assert e.fork(2, 0) is None
    assert e.log[-1].outcome == "full exhausted", e.log[-1]
    e.check()


# The 2-minute fuzz of swa (seed 7) on the decode node: a fork retracted there and resumed. At page size 1
# SGLang's decode queue budgets available_size() plus the tree's full-evictable tokens and reclaims no SWA,
# so the resume waits; the tree reference once counted the tree's evictable SWA and predicted success.
DECODE_RESUME_AT_PAGE_SIZE_1 = [
    ("admit", {"prompt_len": 2}), ("prefill", {"rid": 1, "chunk": 4}), ("transfer", {"rid": 1}),
    ("fork", {"src_rid": 1, "extra": 5}), ("decode", {"rids": [1]}),
    ("decode_speculative", {"rid": 1, "draft": 1, "accepted": 1}), ("fork", {"src_rid": 1, "extra": 1}),
    ("fork", {"src_rid": 1, "extra": 1}), ("prefill", {"rid": 2, "chunk": 16}), ("fork", {"src_rid": 2, "extra": 4}),
    ("decode_speculative", {"rid": 1, "draft": 1, "accepted": 0}),
    ("decode_speculative", {"rid": 1, "draft": 2, "accepted": 2}), ("retract", {"rid": 2}),
    ("resume", {"node": "decode"})]


def test_a_decode_node_resume_at_page_size_1_waits_as_the_queue_gate_says(tree_api):
    e = _engine("swa")
    for op, args in DECODE_RESUME_AT_PAGE_SIZE_1:
        getattr(e, op)(**args)
        e.check()
    # the gate's one budget (available_size() plus full-evictable tokens) is short, and both sides agree
    assert (e.log[-1].op, e.log[-1].outcome) == ("resume", "Req(2) waits: swa exhausted")
    e.sweep()
    e.drain()


def test_both_tree_cores_run_the_prefill_node_on_the_default_and_the_decode_server_on_python(tree_api, monkeypatch):
    from poolfuzz.adapters.sglang import build_family

    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
    prefill, decode = (build_family(CONFIGS["dense"], node=n) for n in ("prefill", "decode"))
    assert "rust" in type(prefill.tree.tree_core).__module__
    assert "rust" not in type(decode.tree.tree_core).__module__
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")  # a named core serves both
    assert "rust" not in type(build_family(CONFIGS["dense"], node="prefill").tree.tree_core).__module__
