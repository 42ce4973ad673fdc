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
