"""``--family sglang:unified``: SGLang's scheduler on a server with ``--enable-unified-memory``.

The server of ``scheduling.py`` with the flag: SGLang's configurator builds the unified memory pool for the model (one
byte buffer whose sub-pools hand out virtual ids, ``unified_pool/``), and SGLang's own scheduler runs on it: the
prefill adder's joint budget for a request's state slots and tokens, the unified radix tree the registry picks, and
the lazy compaction (``flush_opportunistic``) the scheduler runs when idle, which moves rows between physical pages
and rebinds the tables. The model-runner stand-in addresses the pool as the kernels do: KV through the sub-allocators'
virtual -> physical tables (``Component.translate``), state through ``translate_mamba_indices``, and writes through the
pool's own door with the physical write location (``KVWriteLoc(translate_write_loc(loc), physical=True)``).

Stood in for, beyond ``scheduling.py``'s: nothing; ``Scheduler.__init__``'s ``prewarm_compaction`` runs where the
family is built. A model the configurator builds no unified pool for (neither mamba nor sliding-window layers), and
what ``unified.unified_problem`` names (a speculative draft's caches), is declined with the reason.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.scheduler.scheduling import SglangSchedulerDriver, server_arguments
from poolfuzz.adapters.sglang.unified_pool.unified import SERVER_FLAGS, build_unified
from poolfuzz.pools.config import ModelConfig


class UnifiedServerDriver(SglangSchedulerDriver):
    """One example's server with ``--enable-unified-memory`` (see the module)."""

    label = "the sglang unified-memory server"
    unified = True
    drives_speculative = False  # the unified pool's per-draft caches are declined (unified.unified_problem)

    def server_flags(self, config: ModelConfig, *, max_running_requests: int) -> dict:
        return server_arguments(config, max_running_requests=max_running_requests) | SERVER_FLAGS

    def build_family(self, config: ModelConfig, max_running: int):
        """The unified family over the pools SGLang's configurator builds for the server's flags."""
        return build_unified(config)


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the unified-memory server does not drive ``config``, or None: the unified pool's own reasons first."""
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as scheduler_reason
    from poolfuzz.adapters.sglang.unified_pool.unified import unified_problem

    return unified_problem(load(), config) or scheduler_reason(config, UnifiedServerDriver)


def build_unified_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None) -> UnifiedServerDriver:
    """The unified-memory server's driver (``servers.build_driver``'s checks of the run's options)."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode, driver_cls=UnifiedServerDriver)
