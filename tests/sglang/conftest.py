"""Tests against the real SGLang installed in this environment (CI installs two, each in its own).

``POOLFUZZ_SGLANG_EXPECT`` says what the installed release must do: ``pass`` (fixed releases,
0.5.19 on) or ``35957`` (a release before the fix). CI sets it, and then a missing or broken
SGLang is a failure. Without it the expectation is read from the release itself (does its KV
pool declare ``cpu_copy_carries_mamba``, the fix's marker), and a missing SGLang skips.
"""

from __future__ import annotations

import os

import pytest

from tests.sglang.servers import server_module


EXPECT = os.environ.get("POOLFUZZ_SGLANG_EXPECT")


@pytest.fixture(scope="session")
def api():
    from poolfuzz.adapters.sglang.api import SGLangUnavailable, load

    try:
        return load()
    except SGLangUnavailable as exc:
        if EXPECT:
            pytest.fail(f"POOLFUZZ_SGLANG_EXPECT={EXPECT} but SGLang is unusable here: {exc}")
        pytest.skip(f"SGLang is not installed in this environment ({exc}); CI runs these in its SGLang venvs")


@pytest.fixture(scope="session")
def expect(api) -> str:
    if EXPECT:
        assert EXPECT in ("pass", "35957"), f"POOLFUZZ_SGLANG_EXPECT must be pass or 35957, got {EXPECT!r}"
        return EXPECT
    return "pass" if api.kv_pools_declare_mamba else "35957"


@pytest.fixture(scope="module")
def scheduling(api):
    """The scheduler path's module, where this release's Scheduler can be driven (else the test skips, saying why)."""
    from poolfuzz.adapters.sglang.scheduler import scheduling

    reason = scheduling.release_problem()
    if reason:
        pytest.skip(reason)
    return scheduling


@pytest.fixture(scope="module")
def unified(scheduling):
    """The unified-memory server's module, where this release has the unified pool SGLang's scheduler runs on."""
    return server_module("unified_server", "hybrid-linear")


@pytest.fixture(scope="module")
def hicache_server(scheduling):
    """The HiCache server's module, where this release's tree can be given a host tier here (else the test skips)."""
    return server_module("hicache_server", "dense")
