"""The environment a server of a config runs in, as an operator starts it: what its configurator sizes pools in."""

from __future__ import annotations

import os

from poolfuzz.pools.errors import ConfigError

INTERVAL_VARIABLE = "SGLANG_SWA_EVICTION_INTERVAL"


def eviction_interval(config) -> int:
    """The decode-time SWA eviction interval the adapter runs SGLang with for ``config``:
    ``SGLANG_SWA_EVICTION_INTERVAL`` where the environment sets it, else SGLang's default scaled to the harness's
    contexts. The default, 128 tokens, is one window of gpt-oss (sliding window 128) and a fraction of longer
    windows; a harness context is tens of tokens, where 128 would never evict. One window here keeps gpt-oss's
    ratio."""
    value = os.environ.get(INTERVAL_VARIABLE)
    if not value:
        return max(1, config.sliding_window)
    try:  # read here, not through SGLang's envs: releases before the variable (0.5.12) have no such entry
        return max(1, int(value))
    except ValueError:
        raise ConfigError(f"{INTERVAL_VARIABLE}={value!r} is not a number of tokens; set it to an integer, or unset "
                          "it to evict once a window") from None


def server_environment(config) -> dict[str, str]:
    """The environment a server of ``config`` runs in, as an operator would start it: for a model with a sliding
    window, ``SGLANG_SWA_EVICTION_INTERVAL`` at :func:`eviction_interval`. SGLang reads it at every
    ``maybe_evict_swa`` and when its configurator sizes the window pool of a server without a radix cache (a PD
    decode server's: ``compute_swa_request_cap``), so the pools are built in it too (``configurator.configure``)."""
    return {INTERVAL_VARIABLE: str(eviction_interval(config))} if config.has_swa else {}
