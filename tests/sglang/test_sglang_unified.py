"""``--family sglang:unified``: SGLang's unified memory pool (0.5.23's ``--enable-unified-memory``), driven
through the same operations and checks, and caught when one of its allocators is broken."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from tests.engine_fuzz import fuzz_family

DRIVEN = ["hybrid-linear", "hybrid-extra-buffer", "swa", "mla-ssm"]  # swa-ssm: see the tri-pool defect below


def _factory_or_skip(api, name=None):
    from poolfuzz.adapters.sglang import build_unified_family, unified_unsupported_reason

    why = unified_unsupported_reason(CONFIGS[name or DRIVEN[0]])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_unified_family


def _engine(api, name="hybrid-linear"):
    return Engine(config=CONFIGS[name], family_factory=_factory_or_skip(api, name))


def _two_then_one_finished(e):
    """a and b prefilled, a finished: SGLang's lazy free leaves a hole under b, which its compaction fills by
    moving b's rows (at the scheduler's sync boundary)."""
    a = e.admit(6)
    e.prefill(a, 6)
    b = e.admit(5)
    e.prefill(b, 5)
    e.check()
    e.finish(a)
    e.decode([b])
    e.sweep()
    return b


def test_a_release_without_the_unified_pool_is_refused_by_name(api):
    from poolfuzz.adapters.sglang import unified_unsupported_reason
    from poolfuzz.adapters.sglang.unified_pool.unified import unified_mamba_factory

    why = unified_unsupported_reason(CONFIGS["hybrid-linear"])
    try:
        from sglang.srt.mem_cache.allocator.unified_sub_pool import MultiEndedAllocator  # noqa: F401
        layout = True
    except ImportError:
        layout = False
    if unified_mamba_factory() is None:
        assert "has no unified memory pool" in why and "--family sglang" in why
    elif not layout:
        assert "predates the layout poolfuzz drives" in why and "--family sglang" in why
    else:
        assert why is None


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid-spec", "dsa-ssm-ps64"])
def test_configs_the_unified_family_does_not_drive_are_refused_in_one_line(api, name):
    from poolfuzz.adapters.sglang import build_unified_family, unified_unsupported_reason

    _factory_or_skip(api)
    why = unified_unsupported_reason(CONFIGS[name])
    assert why and "\n" not in why
    with pytest.raises(ConfigError, match="sglang:unified|unified|hybrid"):
        build_unified_family(CONFIGS[name])


def test_a_unified_server_sglang_refuses_is_declined_in_its_words(api):
    """``hybrid-linear-ps4`` with ``--enable-unified-memory``: SGLang refuses a no_buffer mamba server at page size 4,
    so the family declines it before a run (it was fuzzed, where Triton runs, and every example reported the
    refusal as a crash at step 0)."""
    from poolfuzz.adapters.sglang import build_unified_family, unified_unsupported_reason
    from poolfuzz.adapters.sglang.pools import configurator

    _factory_or_skip(api)
    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    why = unified_unsupported_reason(CONFIGS["hybrid-linear-ps4"])
    assert why and "--enable-unified-memory" in why and "no_buffer only supports page_size=1" in why
    with pytest.raises(ConfigError, match="no_buffer only supports page_size=1"):
        build_unified_family(CONFIGS["hybrid-linear-ps4"])


def test_a_model_the_releases_factory_refuses_is_declined_before_a_run(api, monkeypatch):
    """SGLang's SWA factory (0.5.22, 0.5.23) asserts that an SWA hybrid without full-attention layers is
    degenerate; the family says so when asked which configs it drives (a run used to count swa-only in and
    crash at every example). Here the refusal is planted, so the test holds on any release with the pool."""
    from poolfuzz.adapters.sglang import build_unified_family, unified_unsupported_reason
    from poolfuzz.adapters.sglang.unified_pool import unified

    _factory_or_skip(api)
    config = CONFIGS["swa-only"].replace(name="swa-only-refused")

    def refuse(*args, **kwargs):
        raise AssertionError("SWA-hybrid with zero full-attention layers is degenerate")

    monkeypatch.setattr(unified, "_build", refuse)
    why = unified_unsupported_reason(config)
    assert why and "refuses this model's layers" in why and "degenerate" in why and "\n" not in why
    with pytest.raises(ConfigError, match="degenerate"):
        build_unified_family(config)


def test_an_allocator_whose_first_allocation_launches_a_kernel_that_cannot_run_is_declined(api, monkeypatch):
    """0.5.22's unified allocator zeroes the pages it hands an MLA sub-pool with a Triton kernel: without Triton,
    ``mla-ssm`` crashed at the first prefill of every example. The probe allocates one token on its throwaway stack,
    so such a config is declined with the reason; planted here (the allocator raises as a missing kernel does), so
    the test holds on any release with the pool."""
    from poolfuzz.adapters.sglang import unified_unsupported_reason
    from poolfuzz.adapters.sglang.unified_pool import unified

    _factory_or_skip(api)
    config = CONFIGS["hybrid-linear"].replace(name="hybrid-linear-kernel")
    built = unified._build

    def build_with_a_kernel(*args, **kwargs):
        family = built(*args, **kwargs)
        monkeypatch.setattr(family.sg_allocator, "alloc", lambda n: (_ for _ in ()).throw(
            TypeError("'function' object is not subscriptable")))
        return family

    monkeypatch.setattr(unified, "_build", build_with_a_kernel)
    why = unified_unsupported_reason(config)
    assert why and "first allocation" in why and "Triton" in why and "\n" not in why


def test_the_family_is_sglangs_unified_stack_seen_through_virtual_ids(api):
    e = _engine(api)
    fam = e.families["prefill"]
    assert type(fam.sg_allocator).__name__ == "UnifiedMambaTokenToKVPoolAllocator"
    assert type(fam.sg_req_pool).__name__ == "UnifiedHybridReqToTokenPool"
    # the components the harness reads are mirrors: none shares storage with SGLang's byte buffer
    raw = fam.unified_buffer._raw.untyped_storage().data_ptr()
    assert all(c.tensor.untyped_storage().data_ptr() != raw for c in fam.components())
    assert {m.physical.untyped_storage().data_ptr() for m in fam.mirrors} == {raw}


def _mover(api, cls):
    """The sub-pool allocator class whose ``_move_pages`` (the compaction's page move) a test plants a broken move
    in; a release that moves pages another way (0.5.22) skips, saying so."""
    if not hasattr(cls, "_move_pages"):
        pytest.skip(f"sglang {api.version}: {cls.__name__} has no _move_pages (its compaction moves pages another "
                    "way), where these tests plant a broken move")
    return cls


def test_an_mla_hybrid_is_built_with_the_mla_sub_pool(api):
    """As the configurator builds it for an MLA model (``use_mla_backend``): one latent row a layer, which
    the harness checks as its compressed and rope parts; a compaction that moves no data is caught there."""
    e = _engine(api, "mla-ssm")
    fam = e.families["prefill"]
    assert type(fam.sg_kv_pool.full_kv_pool).__name__ == "UnifiedMLATokenToKVPool"
    names = {c.name for c in fam.components()}
    assert {"mla.latent", "mla.rope"} <= names and not {"full.k", "full.v"} & names
    cls = _mover(api, type(fam.sg_allocator.full_attn_allocator))
    real = cls._move_pages
    try:
        cls._move_pages = lambda self, src, dst: None  # rebinds, but moves no data
        with pytest.raises(PoolfuzzFailure) as err:
            _two_then_one_finished(e)
    finally:
        cls._move_pages = real
    assert err.value.divergence.kind == "state-lost"
    assert err.value.divergence.component in ("mla.latent", "mla.rope"), err.value


def test_compaction_moves_a_live_requests_rows_and_the_checksums_follow_them(api):
    e = _engine(api)
    fam = e.families["prefill"]
    full = fam.sg_allocator.full_attn_allocator
    moves = []
    cls = _mover(api, type(full))
    real = cls._move_pages
    try:
        cls._move_pages = lambda self, src, dst: (moves.append(src.numel()), real(self, src, dst))[1]
        b = _two_then_one_finished(e)
        slots = fam.req_pool.read(e.requests[b].kv.req_pool_idx, 0, 5)
        assert sum(moves) > 0  # SGLang moved physical pages while b was live
        assert 0 not in full.translate_kv_loc(slots).tolist()
        e.sweep()  # b's KV, read where the table now points, is still b's
    finally:
        cls._move_pages = real


def test_a_compaction_that_copies_nothing_is_caught_as_state_loss(api, monkeypatch):
    e = _engine(api)
    cls = _mover(api, type(e.families["prefill"].sg_allocator.full_attn_allocator))
    monkeypatch.setattr(cls, "_move_pages", lambda self, src, dst: None)  # rebinds, but moves no data
    with pytest.raises(PoolfuzzFailure) as err:
        _two_then_one_finished(e)
    assert err.value.divergence.kind == "state-lost"


def test_a_sub_pool_free_that_keeps_a_slot_is_caught(api, monkeypatch):
    e = _engine(api)
    cls = type(e.families["prefill"].sg_allocator.full_attn_allocator)
    real = cls._free_lazy

    def keeps_one(self, free_index, pages=None):
        real(self, free_index, pages)
        self.free_virtual_ids = self.free_virtual_ids[:-1]  # the last page freed never comes back

    monkeypatch.setattr(cls, "_free_lazy", keeps_one)
    a = e.admit(4)
    e.prefill(a, 4)
    with pytest.raises(PoolfuzzFailure) as err:
        e.finish(a)
        e.check()
    assert "full" in str(err.value)


def test_a_mapping_that_is_not_written_is_caught(api, monkeypatch):
    e = _engine(api)
    import sglang.srt.mem_cache.allocator.unified_sub_pool as sub_pool

    real = sub_pool.alloc_bind_inplace

    def drops_last(v_pages, v2p, p2v, start_phys):
        out = real(v_pages, v2p, p2v, start_phys)
        if v_pages.numel() > 1:
            v2p[v_pages[-1]] = -1  # the last page's mapping is never written
        return out

    monkeypatch.setattr(sub_pool, "alloc_bind_inplace", drops_last)
    with pytest.raises(PoolfuzzFailure) as err:
        a = e.admit(4)
        e.prefill(a, 4)
        b = e.admit(3)
        e.prefill(b, 3)  # its last token is written where a's last token is read: the page-0 sink
        e.sweep()
    assert err.value.divergence.kind == "state-lost" and err.value.divergence.rid == a


@pytest.mark.parametrize("name", DRIVEN)
def test_the_state_machine_finds_nothing_on_the_unified_pool(api, name):
    outcome = fuzz_family(_factory_or_skip(api, name), CONFIGS[name], examples=25)
    assert outcome.failure is None, f"{outcome.failure}\n" + "\n".join(map(str, outcome.steps))


def test_the_reference_counts_virtual_ids_and_asks_sglang_whether_bytes_fit(api):
    e = _engine(api)
    fam, ref = e.families["prefill"], e.refs["prefill"]
    full = fam.sg_allocator.full_attn_allocator
    assert ref.capacity["full"] == (full.num_virtual_ids - full.min_page_index) * full.pool_page_size
    assert ref.capacity["full"] > CONFIGS["hybrid-linear"].full_tokens  # ids for more than the byte budget
    a = e.admit(20)
    e.prefill(a, 20)
    e.check()
    assert ref.available("full") == fam.free_lists()["full"].available_size()
    torch.testing.assert_close(torch.tensor(ref.available("full")),
                               torch.tensor(ref.capacity["full"] - 20))


def test_a_window_eviction_that_keeps_the_swa_pages_is_caught(api, monkeypatch):
    e = _engine(api, "swa")
    fam = e.families["prefill"]
    cls = type(fam.sg_allocator)  # every SWA tombstone path keeps the pages bound
    monkeypatch.setattr(cls, "free_swa", lambda self, free_index: None)
    monkeypatch.setattr(cls, "free_swa_segment", lambda self, free_index, *, start_pos: None)
    window = CONFIGS["swa"].sliding_window
    a = e.admit(window + 6)
    with pytest.raises(PoolfuzzFailure) as err:
        e.prefill(a, window + 6)
        for _ in range(4):
            e.decode([a])
            e.evict_swa()
        e.sweep()
    assert "swa" in str(err.value)


def _tri_pool_translates_its_backups():
    """Whether this release's ``UnifiedMambaPool`` translates the (virtual) slots its CPU copy is handed."""
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMambaPool

    return UnifiedMambaPool.get_cpu_copy is not MambaPool.get_cpu_copy


def _retract_and_resume(e):
    a = e.admit(1)
    e.admit(1)
    e.prefill(a, 1)
    e.retract(a)
    e.resume("prefill")
    e.sweep()


def test_the_tri_pool_retraction_defect_of_sglang_0_5_23_is_found(api, monkeypatch):
    """A real defect: on the tri-pool (Mamba + SWA, ``init_unified_mamba_swa_pools``) the KV pool does not
    carry the recurrent state, so ``Req.offload_kv_cache`` backs it up with ``mamba_pool.get_cpu_copy`` and
    restores it with ``load_cpu_copy``, handing them the request's VIRTUAL mamba slot; ``UnifiedMambaPool``
    indexes physical rows and does not translate. The backup reads another row (zeros here) and the restore
    writes into whatever physical row the virtual id names, which can be another request's SWA KV."""
    e = _engine(api, "swa-ssm")
    if _tri_pool_translates_its_backups():
        _retract_and_resume(e)  # fixed in this release: nothing to find
        return
    with pytest.raises(PoolfuzzFailure) as err:
        _retract_and_resume(e)
    assert err.value.divergence.kind == "state-lost" and "mamba" in str(err.value)
    # ...and the same program passes once the pool translates, as its two-pool sibling's KV pool does
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMambaPool

    monkeypatch.setattr(UnifiedMambaPool, "get_cpu_copy",
                        lambda self, idx: MambaPool.get_cpu_copy(self, self.host_transfer_translate(idx)))
    monkeypatch.setattr(UnifiedMambaPool, "load_cpu_copy",
                        lambda self, cpu, idx: MambaPool.load_cpu_copy(self, cpu, self.host_transfer_translate(idx)))
    _retract_and_resume(_engine(api, "swa-ssm"))


def test_a_resume_is_billed_in_whole_pages_as_the_reference_counts_it(api):
    """A paged hybrid model's resume asks the joint budget for whole pages of KV, as SGLang's prefill adder
    bills them (``ceil_paged_tokens``): with one free page and a mamba slot's worth of bytes short, the resume
    waits, and pools and reference agree (it used to ask for its 3 raw tokens, take the page, and disagree)."""
    # dsa-ssm-ps64's sizes as an MLA model: the unified pool is built for MLA hybrids, not DSA ones
    config = CONFIGS["dsa-ssm-ps64"].replace(name="mla-ssm-ps64", attention="mla")
    from poolfuzz.adapters.sglang import build_unified_family, unified_unsupported_reason

    why = unified_unsupported_reason(config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    e = Engine(config=config, family_factory=build_unified_family)
    rid = e.admit(3)
    e.prefill(rid, 3)
    e.retract(rid)
    assert e.resume("prefill") is None, "the resume was admitted on its raw tokens"
    assert e.retracted["prefill"] == [rid]  # it waits, still first in line
    e.check()


def test_the_family_runs_on_the_pools_sglangs_configurator_builds_for_the_unified_server(api):
    """``swa`` with ``--enable-unified-memory``: SGLang's configurator builds the same sub-pool classes and layers as
    the family's wiring, and sizes the sliding-window side from the unified byte envelope (63 tokens for a 64-token
    server at ratio 0.5, where the wiring named the config's 32): the family runs on the server's own pools. A model
    whose recurrent state is another model's (the config's two conv tensors, a Qwen3-Next's one) keeps the wiring and
    says why."""
    from poolfuzz.adapters.sglang.pools import configurator

    factory = _factory_or_skip(api, "swa")
    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    fam = factory(CONFIGS["swa"])
    assert fam.pools_source.startswith("SGLang's KV cache configurator (") and "--enable-unified-memory" in fam.pools_source
    server = configurator.configure(CONFIGS["swa"], role_flags={"enable_unified_memory": True})
    assert fam.sg_allocator.swa_attn_allocator is not None and fam.sg_allocator.size == server.allocator.size
    assert fam.sg_allocator.size != CONFIGS["swa"].swa_tokens  # the server's sizing, not the config's number
    hybrid = factory(CONFIGS["hybrid-linear"])
    assert hybrid.pools_source.startswith("the adapter's wiring (SGLang's configurator builds other pools")
