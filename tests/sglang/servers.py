"""The scheduler-path server modules the SGLang tests drive, skipped where the installed release lacks one."""

from __future__ import annotations

import pytest


def server_module(name: str, config: str, *, probe: str = "unsupported_reason"):
    """The scheduler-path server module ``poolfuzz.adapters.sglang.scheduler.NAME``, where its ``probe`` says this
    release runs that server on ``config`` (else the test skips, with the module's reason)."""
    import importlib

    from poolfuzz.pools.config import CONFIGS

    module = importlib.import_module(f"poolfuzz.adapters.sglang.scheduler.{name}")
    reason = getattr(module, probe)(CONFIGS[config])
    if reason:
        pytest.skip(reason)
    return module


def shared_traffic(driver, steps: int = 200) -> None:
    """A request every other step, sharing up to five earlier requests' prefixes, more than the device pool holds:
    nodes are evicted to the host (and, with an L3 tier, on to storage) and later prefixes end there (seeded, so the
    same traffic every run)."""
    import random

    draw = random.Random(2)
    for i in range(steps):
        if i % 2 == 0:
            driver.add_request(length=draw.randint(4, 30), share=draw.randint(0, 5), max_tokens=draw.randint(1, 8))
        driver.step()
