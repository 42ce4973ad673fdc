"""``--family sglang:unified-server`` and ``sglang:unified-decode``: SGLang's scheduler on a server, and on a PD decode
server, with ``--enable-unified-memory``.

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

The PD decode server (:class:`UnifiedDecodeDriver`) is ``decode_server.py``'s with the flag, over the pools SGLang's
configurator builds for the decode server it stands for (``unified.build_unified(node="decode")``, with its role flags
and its Mooncake transfer) where they hold the config's layers, sizes aside; the config is declined otherwise. SGLang's
decode side names *physical* rows for the transfer (``translate_kv_indices_for_transfer``, the SWA window's
``translate_swa_indices_for_transfer``, ``translate_mamba_indices``), and the prefill stand-in lands the bytes there
(``runner.receive_prefill``), as the connector writes into the registered page envelopes. Its retraction is SGLang's
own, with the backup SGLang resolves for the pools. The server it stands for transfers with Mooncake (SGLang refuses
``--enable-unified-memory`` with PD disaggregation over any other backend; :data:`REAL_TRANSFER`, which its listing
and its refusal check use); the driver starts SGLang's ``fake`` backend in its place, as ``decode_server.py`` does,
since the transfer is the prefill stand-in's.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.scheduler.decode_server import ROLE_FLAGS, SglangDecodeDriver, decode_problem
from poolfuzz.adapters.sglang.scheduler.scheduling import SglangSchedulerDriver
from poolfuzz.adapters.sglang.unified_pool.unified import SERVER_FLAGS, build_unified
from poolfuzz.pools.config import ModelConfig

# The transfer backend of the unified decode server a user runs (the driver's is SGLang's fake one, see the module).
REAL_TRANSFER = {"disaggregation_transfer_backend": "mooncake"}


class UnifiedMemory:
    """What a server started with ``--enable-unified-memory`` adds to the driver it is mixed into: the flag, and
    the Scheduler's ``enable_unified_memory``; no speculative config (the unified pool's per-draft caches are
    declined, ``unified.unified_problem``)."""

    unified = True
    drives_speculative = False

    def server_flags(self, config: ModelConfig, *, max_running_requests: int) -> dict:
        return super().server_flags(config, max_running_requests=max_running_requests) | SERVER_FLAGS


class UnifiedServerDriver(UnifiedMemory, SglangSchedulerDriver):
    """One example's server with ``--enable-unified-memory`` (see the module)."""

    label = "the sglang unified-memory server"
    pool_flags = SERVER_FLAGS  # a server sized by its memory: the unified envelope's answer (``server_sized``)

    def build_family(self, config: ModelConfig, max_running: int):
        """The unified family over the pools SGLang's configurator builds for the server's flags."""
        return build_unified(config)


class UnifiedDecodeDriver(UnifiedMemory, SglangDecodeDriver):
    """One example's PD decode server with ``--enable-unified-memory`` (see the module)."""

    label = "the sglang unified-memory decode server"

    # The server it stands for (its Mooncake transfer: SGLang refuses the unified pool with PD over the fake backend
    # the driver starts), whose pools SGLang's configurator builds and sizes (``server_sized``).
    pool_flags = ROLE_FLAGS | SERVER_FLAGS | REAL_TRANSFER

    def build_family(self, config: ModelConfig, max_running: int):
        return build_unified(config, node="decode", role_flags=self.pool_flags)

    @property
    def listed_flags(self) -> dict:
        """The server it stands for: the decode server's flags with the transfer backend a unified one runs."""
        return super().listed_flags | REAL_TRANSFER


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the unified-memory server does not drive ``config``, or None: the unified pool's own reasons first."""
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as scheduler_reason
    from poolfuzz.adapters.sglang.unified_pool.unified import unified_problem

    return unified_problem(load(), config) or scheduler_reason(config, UnifiedServerDriver)


def decode_unsupported_reason(config: ModelConfig, *, backup_mode: str | None = None) -> str | None:
    """Why the unified-memory decode server does not drive ``config``, or None: the decode server's reasons, then the
    unified pool's (SGLang's refusal of the Mooncake decode server it stands for among them)."""
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as scheduler_reason
    from poolfuzz.adapters.sglang.unified_pool.unified import unified_problem

    return (decode_problem(config) or unified_problem(load(), config, role_flags=UnifiedDecodeDriver.pool_flags)
            or scheduler_reason(config, UnifiedDecodeDriver, backup_mode=backup_mode))


def build_unified_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None,
                         driver_cls=UnifiedServerDriver):
    """A unified-memory server's driver, ``driver_cls`` (``servers.build_driver``'s checks of the run's options)."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode, driver_cls=driver_cls)


def build_unified_decode_driver(config: ModelConfig, *, device="cpu", faults=(),
                                backup_mode=None) -> UnifiedDecodeDriver:
    """The unified-memory decode server's driver."""
    return build_unified_driver(config, device=device, faults=faults, backup_mode=backup_mode,
                                driver_cls=UnifiedDecodeDriver)
