"""SGLang's unified memory pool (``--enable-unified-memory``) as its servers build and run it (adapters/sglang/
unified_pool/): declined in SGLang's words where it is not built, built as SGLang's configurator builds it, and
caught through SGLang's own scheduler when one of its allocators is broken (planted defects)."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, LostKv


def _served() -> str:
    """How a family on the pools SGLang built for its server names their source: the builder (its configurator, or
    before 0.5.16 its model runner), then the server's flags."""
    from poolfuzz.adapters.sglang.pools.configurator import builder

    return builder() + " ("


def test_a_release_without_the_unified_pool_is_refused_by_name(api, scheduling):
    from poolfuzz.adapters.sglang.scheduler.unified_server import unsupported_reason
    from poolfuzz.adapters.sglang.unified_pool.unified import unified_mamba_factory

    why = unsupported_reason(CONFIGS["hybrid-linear"])
    try:
        from sglang.srt.mem_cache.allocator.unified_sub_pool import MultiEndedAllocator
    except ImportError:
        MultiEndedAllocator = None
    if unified_mamba_factory() is None:
        assert "has no unified memory pool" in why and "--family sglang" in why
    elif MultiEndedAllocator is None:
        assert "predates the layout poolfuzz drives" in why and "--family sglang" in why
    elif not hasattr(MultiEndedAllocator, "translate_write_loc"):
        # 0.5.20 and 0.5.21: the layout is there, but a forward hands the pool its write location another way
        # (translate_write_loc_for_kernel); the write door poolfuzz drives is 0.5.22's
        assert "has no translate_write_loc" in why and "--family sglang" in why
    else:
        assert why is None


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid-spec", "dsa-ssm-ps64"])
def test_configs_the_unified_server_does_not_drive_are_declined_in_one_line(unified, name):
    why = unified.unsupported_reason(CONFIGS[name])
    assert why and "\n" not in why
    with pytest.raises(ConfigError, match="unified|hybrid"):
        unified.build_unified_driver(CONFIGS[name])


def test_a_unified_server_sglang_refuses_is_declined_in_its_words(api, unified):
    """``hybrid-linear-ps4`` with ``--enable-unified-memory``: SGLang refuses a no_buffer mamba server at page size 4,
    so the server is declined before a run, in SGLang's words."""
    from poolfuzz.adapters.sglang.pools import configurator

    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    why = unified.unsupported_reason(CONFIGS["hybrid-linear-ps4"])
    assert why and "--enable-unified-memory" in why and "no_buffer only supports page_size=1" in why
    with pytest.raises(ConfigError, match="no_buffer only supports page_size=1"):
        unified.build_unified_driver(CONFIGS["hybrid-linear-ps4"])


def test_a_model_the_releases_factory_refuses_is_declined_before_a_run(unified, monkeypatch):
    """SGLang's SWA factory (0.5.22, 0.5.23) asserts that an SWA hybrid without full-attention layers is
    degenerate; the server says so when asked which configs it drives. Here the refusal is planted, so the test holds
    on any release with the pool."""
    from poolfuzz.adapters.sglang.unified_pool import unified as pools

    config = CONFIGS["swa-only"].replace(name="swa-only-refused")

    def refuse(*args, **kwargs):
        raise AssertionError("SWA-hybrid with zero full-attention layers is degenerate")

    monkeypatch.setattr(pools, "build_swa", refuse)
    why = unified.unsupported_reason(config)
    assert why and "refuses" in why and "degenerate" in why and "\n" not in why
    with pytest.raises(ConfigError, match="degenerate"):
        unified.build_unified_driver(config)


def test_an_allocator_whose_first_allocation_launches_a_kernel_that_cannot_run_is_declined(unified, monkeypatch):
    """0.5.22's unified allocator zeroes the pages it hands an MLA sub-pool with a Triton kernel: without Triton,
    ``mla-ssm`` crashed at the first prefill of every example. The probe allocates one token on the stack SGLang's
    configurator builds for the server, so such a config is declined with the reason; planted here (the allocator raises as a missing kernel does)."""
    from poolfuzz.adapters.sglang.unified_pool import unified as pools

    config = CONFIGS["hybrid-linear"].replace(name="hybrid-linear-kernel")
    built = pools._served_family

    def build_with_a_kernel(*args, **kwargs):
        family = built(*args, **kwargs)
        monkeypatch.setattr(family.sg_allocator, "alloc", lambda n: (_ for _ in ()).throw(
            TypeError("'function' object is not subscriptable")))
        return family

    monkeypatch.setattr(pools, "_served_family", build_with_a_kernel)
    why = unified.unsupported_reason(config)
    assert why and "first allocation" in why and "Triton" in why and "\n" not in why


def test_the_components_are_sglangs_physical_views_read_through_its_tables(unified):
    """What the model-runner stand-in reads and writes: SGLang's own buffers (one shared byte buffer under them all),
    each KV component translating virtual slot ids through its sub-allocator's table."""
    driver = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    family = driver.family
    assert type(family.sg_allocator).__name__ == "UnifiedMambaTokenToKVPoolAllocator"
    assert type(family.sg_req_pool).__name__ == "UnifiedHybridReqToTokenPool"
    raw = family.unified_buffer._raw.untyped_storage().data_ptr()
    assert {c.tensor.untyped_storage().data_ptr() for c in family.components()} == {raw}
    assert all(c.translate is not None for c in family.components() if c.space == "full")


def test_an_mla_hybrid_is_built_with_the_mla_sub_pool(unified):
    """As the configurator builds it for an MLA model (``use_mla_backend``): one latent row a layer, which the runner
    checks as its compressed and rope parts."""
    driver = unified.build_unified_driver(CONFIGS["mla-ssm"])
    assert type(driver.family.sg_kv_pool.full_kv_pool).__name__ == "UnifiedMLATokenToKVPool"
    names = {c.name for c, _ in driver.runner.kv}
    assert {"mla.latent", "mla.rope"} <= names and not {"full.k", "full.v"} & names


def test_the_server_runs_on_the_pools_sglangs_configurator_builds(api, unified):
    """``swa`` with ``--enable-unified-memory``: SGLang's configurator builds the config's layers in its unified
    sub-pools, and sizes the sliding-window side from the unified byte envelope (not the config's 32): the server runs
    on its own pools. So do the Qwen3-Next config, shaped as its model (one
    short conv over the query, key and value widths), and the Inkling one (six short convs in every attention layer,
    no temporal state): SGLang's unified tri-pool of full, window and state rows."""
    from poolfuzz.adapters.sglang.pools import configurator

    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    family = unified.build_unified_driver(CONFIGS["swa"]).family
    assert family.pools_source.startswith(_served())
    assert "--enable-unified-memory" in family.pools_source
    server = configurator.configure(CONFIGS["swa"], role_flags={"enable_unified_memory": True})
    assert family.sg_allocator.swa_attn_allocator is not None and family.sg_allocator.size == server.allocator.size
    assert family.sg_allocator.size != CONFIGS["swa"].swa_tokens  # the server's sizing, not the config's number
    hybrid = unified.build_unified_driver(CONFIGS["hybrid-linear"]).family
    assert hybrid.pools_source.startswith(_served())
    inkling = unified.build_unified_driver(CONFIGS["swa-ssm"]).family
    assert inkling.pools_source.startswith(_served()), inkling.pools_source
    assert type(inkling.sg_req_pool.mamba_pool).__name__ == "UnifiedMambaPool"


# --- planted defects, caught through SGLang's own scheduler ---------------------------------------------------------

def _traffic(driver, *, requests: int = 6, steps: int = 40) -> None:
    """A request every third step, the later ones sharing an earlier prefix, then the server drained."""
    for i in range(steps):
        if i % 3 == 0 and i // 3 < requests:
            driver.add_request(length=4 + i % 5, share=i % 2, max_tokens=3)
        driver.step()


def test_a_mapping_that_is_not_written_is_caught_as_another_requests_kv(unified, monkeypatch):
    """The sub-pool binds a fresh page but never writes its last page's mapping: the page resolves to the page-0 sink
    where every unmapped id collides, and a request reads another request's K there."""
    import sglang.srt.mem_cache.allocator.unified_sub_pool as sub_pool

    real = sub_pool.alloc_bind_inplace

    def drops_last(v_pages, v2p, p2v, start_phys):
        out = real(v_pages, v2p, p2v, start_phys)
        if v_pages.numel() > 1:
            v2p[v_pages[-1]] = -1  # the last page's mapping is never written
        return out

    monkeypatch.setattr(sub_pool, "alloc_bind_inplace", drops_last)
    driver = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.[kv] layer \d+ position \d+: .* holds "):
        _traffic(driver)
        driver.drain()


def test_a_window_eviction_that_keeps_the_swa_pages_is_caught(unified, monkeypatch):
    """The sliding-window side's frees keep their pages bound: the drained server finds the window's pages neither
    free nor held by any request or cached prefix."""
    driver = unified.build_unified_driver(CONFIGS["swa"])
    cls = type(driver.family.sg_allocator)  # every SWA tombstone path keeps the pages bound
    monkeypatch.setattr(cls, "free_swa", lambda self, free_index: None)
    monkeypatch.setattr(cls, "free_swa_segment", lambda self, free_index, *, start_pos: None)
    window = CONFIGS["swa"].sliding_window
    driver.add_request(length=window + 6, share=0, max_tokens=4)
    for _ in range(12):
        driver.step()
    problem = driver.drain()
    assert problem and "leak" in problem and "[swa]" in problem, problem
