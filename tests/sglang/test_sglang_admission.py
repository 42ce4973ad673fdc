"""Admission on the sglang family is SGLang's own: its checks decide, and where they pass the pools act."""

from __future__ import annotations

import pytest

from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.request import ReqKv
from tests.sglang.families import family_or_skip as _family


class _SaysYes:
    """An admission that lets everything through, to see what SGLang's pools do unguarded."""

    def __init__(self, real):
        self.real = real

    def admit(self, family, sg):
        pass

    def decode_fits(self, family, sg, *, new_tokens):
        return True

    def decode_gate(self, family, sg):
        return None  # no check of SGLang's decided, so nothing is vouched for

    def prefill_admitted(self, family, *, prefix_len, seq_len):
        return None


def test_the_mamba_gate_is_sglangs_and_takes_no_row(api):
    """With every mamba slot held, SGLang's check refuses before a row is taken (a chunk-cache config:
    with SGLang's mamba tree the pool is sized at three slots a row, so rows run out first)."""
    fam = _family(api, "hybrid-linear-ps4")
    for rid in range(1, fam.config.mamba_slots + 1):
        fam.protocol.admit(ReqKv(rid=rid, seqlen=1), fam)
    rows_before = fam.free_lists()["rows"].available_size()
    assert rows_before > 0  # the rows are not what is short
    with pytest.raises(PoolExhausted) as info:
        fam.protocol.admit(ReqKv(rid=99, seqlen=1), fam)
    assert info.value.space == "mamba"
    assert fam.free_lists()["rows"].available_size() == rows_before


def test_an_allocation_past_the_gate_reports_what_the_pool_did(api):
    """Without the gate, HybridReqToTokenPool asserts after taking a row: the adapter reports it as a
    pool error and gives nothing back (the taken row shows in the free count)."""
    fam = _family(api, "hybrid-linear-ps4")
    if not api.row_alloc_takes_reqs:
        pytest.skip(f"sglang {api.version} allocates the mamba slot apart from the row")
    for rid in range(1, fam.config.mamba_slots + 1):
        fam.protocol.admit(ReqKv(rid=rid, seqlen=1), fam)
    fam.admission = _SaysYes(fam.admission)
    rows_before = fam.free_lists()["rows"].available_size()
    with pytest.raises(PoolError, match="asserted after SGLang's admission checks passed") as info:
        fam.protocol.admit(ReqKv(rid=99, seqlen=1), fam)
    assert not isinstance(info.value, PoolExhausted)
    assert fam.free_lists()["rows"].available_size() == rows_before - 1


def test_a_decode_after_a_kept_speculative_page_is_refused_when_full(api):
    """A speculative step kept a page, so the next token starts a new one: the capacity check counts
    that page and refuses it when full pages are gone, taking nothing."""
    fam = _family(api, "swa-ps4")
    a, b = ReqKv(rid=1, seqlen=9), ReqKv(rid=2, seqlen=9)
    for req in (a, b):
        fam.protocol.admit(req, fam)
    fam.protocol.extend(a, fam, 8)
    a.kv_committed_len = 5  # a speculative step committed 5 and kept the page up to 8
    fam.protocol.extend(b, fam, fam.config.full_tokens - 8)
    before = {s: v.available_size() for s, v in fam.free_lists().items()}
    assert before["full"] == 0
    with pytest.raises(PoolExhausted) as info:
        fam.protocol.extend(a, fam, 9)
    assert info.value.space == "full"
    assert {s: v.available_size() for s, v in fam.free_lists().items()} == before


class _Gate0519:
    """An allocator whose decode gate has 0.5.19's signature (count and tree only)."""

    page_size = 4

    def __init__(self, free):
        self.free, self.asked = free, []

    def check_decode_capacity(self, *, num_tokens, tree_cache):
        self.asked.append(num_tokens)
        return num_tokens <= self.free


@pytest.mark.parametrize("free, fits", [(8, True), (3, False)])
def test_a_kept_page_asks_the_releases_own_gate_with_what_it_takes(api, free, fits):
    """After a speculative step kept a page, the gate is called with the keywords it names:
    0.5.19's takes no ``requests`` (calling it with them was a TypeError on every paged config)."""
    from types import SimpleNamespace

    from poolfuzz.adapters.sglang.lifecycle.admission import SchedulerAdmission

    gate = _Gate0519(free)
    sg = SimpleNamespace(kv_allocated_len=12, kv_committed_len=10)
    assert SchedulerAdmission(api).decode_fits(SimpleNamespace(sg_allocator=gate), sg, new_tokens=4) is fits
    assert gate.asked == [4]


def _prefill_budget_or_skip(api, name):
    fam = _family(api, name)
    if not hasattr(fam.sg_allocator, "create_prefill_budget"):
        pytest.skip(f"sglang {api.version} has no prefill budget object (the adder computes it inline)")
    return fam


@pytest.mark.parametrize("name, budget", [("dense-ps4", "PrefillBudget"), ("swa-ps4", "SWAPrefillBudget"),
                                          ("swa-only", "SWAPrefillBudget"),
                                          ("hybrid-linear-ps4", "PrefillBudget")])
def test_the_prefill_budget_judges_a_first_extend_as_the_adder_asks_it(api, name, budget):
    """The adder's budget admits a first extend that fits with its page of rounding, and refuses one
    that does not; what it admits, the allocator places."""
    fam = _prefill_budget_or_skip(api, name)
    free = {s: v.available_size() for s, v in fam.free_lists().items()}
    full = min(n for s, n in free.items() if s in ("full", "swa"))
    ps = fam.config.page_size
    assert fam.admission.prefill_admitted(fam, prefix_len=0, seq_len=full - 2 * ps) == budget
    assert fam.admission.prefill_admitted(fam, prefix_len=0, seq_len=full) is None
    assert {s: v.available_size() for s, v in fam.free_lists().items()} == free  # asking takes nothing
    req = ReqKv(rid=1, seqlen=full - 2 * ps)
    fam.protocol.admit(req, fam)
    slots = fam.protocol.extend(req, fam, full - 2 * ps)
    assert slots.numel() == full - 2 * ps


class _AdmitsAll:
    """A prefill budget that admits every extend (the defect the check exists for)."""

    def check_prefill(self, *, extend_input_len, total_tokens, max_new_tokens, input_tokens,
                      swa_host_hit_length, chunk_limit):
        return True, None


class _AdmitsTheRetry(_AdmitsAll):
    """Refuses the first time it is asked, admits after (the request waited, then was admitted)."""

    asked = 0

    def check_prefill(self, **kwargs):
        type(self).asked += 1
        return (type(self).asked > 1), None


def test_an_extend_the_budget_admits_and_the_allocator_cannot_place_is_a_scheduler_crash(api, monkeypatch):
    """Where SGLang's budget admits an extend its allocator then refuses, the scheduler raises 'Prefill out
    of memory': the adapter reports that as OverAdmitted, not as the exhaustion the reference predicts."""
    from poolfuzz.adapters.sglang.lifecycle.admission import OverAdmitted

    fam = _prefill_budget_or_skip(api, "dense-ps4")
    monkeypatch.setattr(type(fam.sg_allocator), "create_prefill_budget",
                        lambda self, tree_cache, num_mixed_decode_tokens=0: _AdmitsAll())
    req = ReqKv(rid=1, seqlen=fam.config.full_tokens + 8)
    fam.protocol.admit(req, fam)
    first = r"_AdmitsAll.check_prefill admitted a \d+-token extend \(the request.s first\).*Prefill out of memory"
    with pytest.raises(OverAdmitted, match=first) as info:
        fam.protocol.extend(req, fam, fam.config.full_tokens + 8)
    assert info.value.space == "full"
    # once judged, the request's later extends are chunks the adder does not judge with check_prefill
    with pytest.raises(PoolExhausted) as later:
        fam.protocol.extend(req, fam, fam.config.full_tokens + 8)
    assert not isinstance(later.value, OverAdmitted)


def test_a_first_extend_that_waited_is_judged_again_when_retried(api, monkeypatch):
    """A first extend the budget refused leaves the request waiting; the adder asks again when the request
    is retried, and a yes that the allocator cannot honour is then OverAdmitted."""
    from poolfuzz.adapters.sglang.lifecycle.admission import OverAdmitted

    fam = _prefill_budget_or_skip(api, "dense-ps4")
    monkeypatch.setattr(type(fam.sg_allocator), "create_prefill_budget",
                        lambda self, tree_cache, num_mixed_decode_tokens=0: _AdmitsTheRetry())
    monkeypatch.setattr(_AdmitsTheRetry, "asked", 0)
    req = ReqKv(rid=1, seqlen=fam.config.full_tokens + 8)
    fam.protocol.admit(req, fam)
    with pytest.raises(PoolExhausted) as waited:
        fam.protocol.extend(req, fam, fam.config.full_tokens + 8)
    assert not isinstance(waited.value, OverAdmitted)
    with pytest.raises(OverAdmitted, match="could not place it"):
        fam.protocol.extend(req, fam, fam.config.full_tokens + 8)
    assert _AdmitsTheRetry.asked == 2


def test_an_over_admitting_budget_is_caught_by_the_fuzzer(api, fuzz, monkeypatch):
    """Through the state machine: the shrunk failure is a pool error naming the budget."""
    fam = _prefill_budget_or_skip(api, "dense-ps4")
    monkeypatch.setattr(type(fam.sg_allocator), "create_prefill_budget",
                        lambda self, tree_cache, num_mixed_decode_tokens=0: _AdmitsAll())
    outcome = fuzz(fam.config, examples=40, shrink=False)
    assert outcome.failure is not None, "a budget that admits what cannot be placed was not caught"
    assert outcome.failure.divergence.check == "pool-error", outcome.failure
    assert "check_prefill admitted" in str(outcome.failure), outcome.failure


def test_a_decode_sglangs_check_lets_through_and_the_allocator_refuses_is_a_scheduler_crash(api):
    """The decode side of the same rule: the scheduler raises 'Decode out of memory' on the allocator's
    None after its decode check said yes. Planted: a check that says yes to a full pool (page size 1: some
    releases' paged decode kernel reads past an empty free list, which the check is there to prevent)."""
    from poolfuzz.adapters.sglang.lifecycle.admission import OverAdmitted

    fam = _family(api, "dense")
    req = ReqKv(rid=1, seqlen=fam.config.full_tokens + 1)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, fam.config.full_tokens)
    req.kv_committed_len = fam.config.full_tokens
    sg = fam.protocol.standin(req, fam)
    sg.kv_committed_len = sg.kv_allocated_len = fam.config.full_tokens  # as the decode step syncs them
    gate = fam.admission.decode_gate(fam, sg)
    if gate is None:
        pytest.skip(f"sglang {api.version} has no decode check of its own; the adapter compares sizes")
    fam.admission.decode_fits = lambda *_, **__: True
    with pytest.raises(OverAdmitted, match=f"{gate} admitted a one-token decode.*Decode out of memory"):
        fam.protocol.extend(req, fam, fam.config.full_tokens + 1)


def test_the_budget_s_chunk_cache_is_built_as_releases_with_a_chunked_prefill_field_build_it(api, monkeypatch):
    """0.5.21's registry context has ``effective_chunked_prefill_size`` (required), and picks the chunk cache
    only where it is set: the context the adapter builds fills it where the release's context has it (the
    0.5.21 compat row crashed at every prefill without it)."""
    import dataclasses

    from sglang.srt.mem_cache import registry

    from poolfuzz.adapters.sglang.tree.tree_build import CHUNKED_PREFILL_SIZE, build_context

    fam = _prefill_budget_or_skip(api, "dense")  # the budget is what builds a chunk cache's context
    base = registry.TreeCacheBuildContext
    if "effective_chunked_prefill_size" not in {f.name for f in dataclasses.fields(base)}:
        assert not hasattr(build_context(fam, hierarchical=False, disabled=True), "effective_chunked_prefill_size")
        fields = [(f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
                  if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                  else (f.name, f.type) for f in dataclasses.fields(base)]
        required = ("effective_chunked_prefill_size", object, dataclasses.field(kw_only=True))  # as in 0.5.21
        monkeypatch.setattr(registry, "TreeCacheBuildContext",
                            dataclasses.make_dataclass("TreeCacheBuildContext0521", fields + [required]))
    ctx = build_context(fam, hierarchical=False, disabled=True)
    assert ctx.effective_chunked_prefill_size == CHUNKED_PREFILL_SIZE and ctx.disable_radix_cache
