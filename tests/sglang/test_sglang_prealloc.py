"""The decode node is SGLang's PD decode server: need_sort allocators and the decode queue's pre-allocation gate."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _engine(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason
    from poolfuzz.adapters.sglang.disaggregation.pd import pd_problem
    from poolfuzz.adapters.sglang.disaggregation.prealloc import gate_problem

    why = unsupported_reason(CONFIGS[name]) or pd_problem(api) or gate_problem(api)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return Engine(config=CONFIGS[name], family_factory=build_family)


def _transfer(e, prompt):
    rid = e.admit(prompt)
    e.prefill(rid, prompt)
    e.check()
    moved = e.transfer(rid)
    e.check()
    return rid, moved


def _waiting_pages(allocator) -> int:
    """Freed pages a need_sort allocator keeps apart (token: ``release_pages``; paged: ``staged_pages``)."""
    sub = getattr(allocator, "full_attn_allocator", allocator)
    staged = getattr(sub, "staged_pages", None)
    if staged is not None:
        return sum(t.numel() for t in staged)
    return sub.release_pages.numel()


def _free_tokens(allocator) -> int:
    return allocator.available_size() - _waiting_pages(allocator) * allocator.page_size


# Configs SGLang 0.5.23 serves with a chunk cache (no tree): a finish frees its pages to the allocator,
# where a tree would keep them cached (hybrid-linear has SGLang's mamba tree since issue 13's forks).
@pytest.mark.parametrize("name", ["hybrid-extra-buffer", "hybrid-linear-ps4"])
def test_only_the_decode_node_keeps_freed_pages_apart_until_sorted(api, name):
    e = _engine(api, name)
    assert not hasattr(e.families["decode"], "tree"), "a tree caches the finished pages: pick a chunk-cache config"
    assert e.families["decode"].pd_decode and not e.families["prefill"].pd_decode
    alloc = e.families["decode"].sg_allocator
    assert alloc.need_sort and not e.families["prefill"].sg_allocator.need_sort
    rid, moved = _transfer(e, 9)
    assert moved
    e.decode([rid])
    e.finish(rid)
    e.check()
    assert _waiting_pages(alloc) > 0, "the finished request's pages wait (need_sort)"
    # transfers that take the sorted free pages, then one that needs the waiting ones merged back
    cap = CONFIGS[name].max_context - 2
    while _free_tokens(alloc) >= cap:
        assert _transfer(e, cap)[1]
    assert _transfer(e, _free_tokens(alloc) + 1)[1]
    assert _waiting_pages(alloc) == 0


@pytest.mark.parametrize("name", ["dense-ps4", "swa-ps4"])
def test_a_transfer_the_decode_queue_refuses_waits_for_the_space_that_is_short(api, name):
    """Fill the decode node, then transfer one more: SGLang's prealloc_fits says no, the transfer waits."""
    e = _engine(api, name)
    asked = []
    alloc_cls = type(e.families["decode"].sg_allocator)
    real = alloc_cls.prealloc_fits

    def spy(self, *args, **kwargs):
        asked.append(kwargs)
        return real(self, *args, **kwargs)

    try:
        alloc_cls.prealloc_fits = spy
        waited = None
        for _ in range(CONFIGS[name].request_rows):
            rid, moved = _transfer(e, CONFIGS[name].max_context - 2)
            if not moved:
                waited = e.log[-1].outcome
                break
    finally:
        alloc_cls.prealloc_fits = real
    assert asked and all("full_budget_tokens" in kw for kw in asked)
    assert waited in ("waits: decode full exhausted", "waits: decode swa exhausted"), waited


def test_a_gate_that_refuses_what_fits_is_an_outcome_mismatch(api, monkeypatch):
    """The reference model knows the transfer fits; a decode queue that leaves it waiting is reported."""
    e = _engine(api, "dense-ps4")
    alloc_cls = type(e.families["decode"].sg_allocator)
    monkeypatch.setattr(alloc_cls, "prealloc_fits", lambda self, *a, **k: False)
    with pytest.raises(PoolfuzzFailure) as info:
        _transfer(e, 5)
    assert info.value.divergence.check == "outcome", info.value


def test_transfer_ids_go_through_the_allocators_translation(api, monkeypatch):
    """The main KV's pages are sent as translate_kv_indices_for_transfer gives them (identity here, so an
    off-by-one page translation moves the wrong page, and the checksums say whose)."""
    e = _engine(api, "dense-ps4")
    alloc_cls = type(e.families["decode"].sg_allocator)
    if not hasattr(alloc_cls, "translate_kv_indices_for_transfer"):
        pytest.skip("this release has no translate_kv_indices_for_transfer")
    monkeypatch.setattr(alloc_cls, "translate_kv_indices_for_transfer",
                        lambda self, idx: torch.where(idx > 0, idx + self.page_size, idx))
    with pytest.raises(PoolfuzzFailure) as info:
        _transfer(e, 5)
    assert info.value.divergence.space == "full", info.value


def test_both_sides_short_names_the_side_the_decode_tree_cannot_evict_for(api):
    """A 2-minute fuzz's false alarm (swa-ssm, seed 3): the decode node's tree holds a finished request,
    full is short of free slots but not of free plus evictable ones, SWA is short of both. One budget
    serves both sides at page size 1, so SGLang names neither; the adapter named full (free slots only)
    where the reference names SWA. Both now count what the tree can evict."""
    e = _engine(api, "swa-ssm")
    if not hasattr(e.families["decode"], "tree"):
        pytest.skip(f"sglang {api.version}: swa-ssm has no tree on the decode node")
    first = e.admit(6)
    e.prefill(first, 6)
    second = e.fork(first, 3)
    assert e.transfer(first)
    e.prefill(second, 10)
    e.finish(first)  # the decode node's tree keeps its tokens, evictable
    third = e.fork(second, 6)
    e.prefill(third, 11)
    fourth = e.fork(third, 6)
    assert e.transfer(second) and e.transfer(third)
    e.prefill(fourth, 6)
    e.check()
    assert not e.transfer(fourth)
    assert e.log[-1].outcome == "waits: decode swa exhausted"
    e.check()


def test_an_arriving_request_on_a_paged_swa_node_reclaims_the_swa_tail_as_pop_preallocated_does(api, monkeypatch):
    """A transfer onto a paged SWA decode node asks ``reclaim_for_prealloc`` for its SWA tail after the fit check
    (``pop_preallocated``'s ``_reclaim_swa_tail_capacity``); a resume does not (its queue reclaims only where
    the allocator's answer counted evictable pages). A reclaim that reports a shortfall where the reference
    knows the tail fits is reported."""
    e = _engine(api, "swa-ps4")
    alloc_cls = type(e.families["decode"].sg_allocator)
    if not hasattr(alloc_cls, "reclaim_for_prealloc"):
        pytest.skip("this release's SWA allocator has no reclaim_for_prealloc")
    asked, real = [], alloc_cls.reclaim_for_prealloc

    def spy(self, tree_cache, full_tokens, swa_tokens):
        asked.append((full_tokens, swa_tokens))
        return real(self, tree_cache, full_tokens, swa_tokens)

    monkeypatch.setattr(alloc_cls, "reclaim_for_prealloc", spy)
    rid, moved = _transfer(e, 14)
    assert moved and asked == [(16, 8)], asked  # 14 tokens: 4 full pages; window 6 from token 8: 2 SWA pages
    monkeypatch.setattr(alloc_cls, "reclaim_for_prealloc", lambda self, *a: "SWA eviction insufficient")
    with pytest.raises(PoolfuzzFailure) as info:
        _transfer(e, 5)
    assert info.value.divergence.check == "outcome", info.value
