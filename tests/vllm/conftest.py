"""Tests against the real vLLM installed in this environment (CI installs two, each in its own venv).

``POOLFUZZ_VLLM_EXPECT`` says what the installed release must do: ``pass`` (0.24.0 on) or ``44409``
(a release before PR #44409). CI sets it, and then a missing or broken vLLM is a failure. Without it
a missing vLLM skips, and the expectation is read from the installed version.
"""

from __future__ import annotations

import os

import pytest

from tests.engine_fuzz import Outcome, fuzz_family


EXPECT = os.environ.get("POOLFUZZ_VLLM_EXPECT")


@pytest.fixture(scope="session")
def api():
    from poolfuzz.adapters.vllm.api import load
    from poolfuzz.pools.errors import ConfigError

    try:
        return load()
    except ConfigError as exc:
        if EXPECT:
            pytest.fail(f"POOLFUZZ_VLLM_EXPECT={EXPECT} but vLLM is unusable here: {exc}")
        pytest.skip(f"vLLM is not installed in this environment ({exc}); CI runs these in its vLLM venvs")


@pytest.fixture(scope="session")
def expect(api) -> str:
    if EXPECT:
        assert EXPECT in ("pass", "44409"), f"POOLFUZZ_VLLM_EXPECT must be pass or 44409, got {EXPECT!r}"
        return EXPECT
    major, minor = (int(x) for x in api.version.split(".")[:2])
    return "pass" if (major, minor) >= (0, 24) else "44409"


def _fuzz(config, *, examples: int, steps: int = 30) -> Outcome:
    """Run the state machine over the vllm family; the shrunk failure, if any."""
    from poolfuzz.adapters.vllm import build_manager_family as build_family

    return fuzz_family(build_family, config, examples=examples, steps=steps)


@pytest.fixture
def fuzz():
    """``fuzz(config, examples=N)``: the state machine over the vllm family, shrunk failure if any."""
    return _fuzz


@pytest.fixture
def double_allocation(monkeypatch):
    """Plant a double allocation in vLLM's BlockPool: ``get_new_blocks`` hands out a block a running request still
    fills (no hash yet: vLLM's own caching assert would catch a cached one) in place of a fresh one."""
    from vllm.v1.core.block_pool import BlockPool

    real = BlockPool.get_new_blocks

    def double_allocating(self, num_blocks, *args, **kwargs):
        blocks = real(self, num_blocks, *args, **kwargs)
        held = [b for b in self.blocks if b.ref_cnt == 1 and not b.is_null and b.block_hash is None and b not in blocks]
        if held and blocks:
            blocks[0].ref_cnt -= 1
            self.free_block_queue.append(blocks[0])
            held[0].ref_cnt += 1
            blocks[0] = held[0]
        return blocks

    monkeypatch.setattr(BlockPool, "get_new_blocks", double_allocating)


@pytest.fixture(scope="session")
def scheduling(api):
    """``adapters.vllm.scheduling``, where this release's Scheduler can be driven (else the test skips, saying why)."""
    from poolfuzz.adapters.vllm import scheduling

    reason = scheduling.release_problem(api)
    if reason:
        pytest.skip(reason)
    return scheduling
