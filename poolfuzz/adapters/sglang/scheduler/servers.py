"""The scheduler-path servers for a run: whether one drives a config (SGLang's own answer, from building it once), and
its driver built with the run's options (``scheduling.py``'s server by default; ``decode_server.py``'s PD decode
server)."""

from __future__ import annotations

from functools import lru_cache

from poolfuzz.adapters.sglang.compat.drift import drift_raised
from poolfuzz.adapters.sglang.scheduler.scheduling import SglangSchedulerDriver, release_problem
from poolfuzz.adapters.sglang.scheduler.spec_worker import speculative_problem
from poolfuzz.pools.config import ModelConfig
from poolfuzz.errors import EngineApiChanged
from poolfuzz.pools.errors import ConfigError


def unsupported_reason(config: ModelConfig, driver_cls=None, *, backup_mode: str | None = None) -> str | None:
    """Why the scheduler path (or ``driver_cls``, a server built on it, with the run's ``backup_mode``) does not drive
    ``config``, or None."""
    from poolfuzz.adapters.sglang.pools.family import unsupported_reason as pools_reason

    return (pools_reason(config) or speculative_problem(config, driver_cls) or release_problem()
            or server_refusal(config, driver_cls or SglangSchedulerDriver, backup_mode))


@lru_cache(maxsize=None)
def server_refusal(config: ModelConfig, driver_cls, backup_mode: str | None = None) -> str | None:
    """SGLang's own answer to whether a server with the driver's flags (and the run's ``backup_mode``) builds the
    config: a driver is built once and what its constructors refuse is the reason. Anything else the build raises
    is no refusal but what a server would crash with at startup: the config is fuzzed, and each example's build
    reports it as a failure found in the engine (with an artifact), not a traceback out of the run."""
    try:
        driver = _built(driver_cls, config, backup_mode)
    except ConfigError as exc:
        return str(exc).split(": ", 1)[-1]
    except EngineApiChanged:
        raise
    except Exception:  # noqa: BLE001 - reported by the examples, where the same build runs under the harness
        return None
    driver.close()  # a server built only to ask: its storage threads and files go now, not at collection
    return None


def build_driver(config: ModelConfig, *, device="cpu", faults=(), backup_mode=None, driver_cls=None):
    """A scheduler-path factory's driver (``driver_cls``, the ``sglang:scheduler`` one by default); its pools live on
    the CPU, where the scheduler runs, whatever ``device`` the run names (as the vLLM scheduler path's do)."""
    driver_cls = driver_cls or SglangSchedulerDriver
    if tuple(faults):
        raise ConfigError(f"{driver_cls.label} runs SGLang's own code; catalogue faults {list(faults)} only "
                          "apply to the builtin family (drop --faults)")
    if backup_mode not in (None, *driver_cls.backup_modes):
        raise ConfigError(f"{driver_cls.label} {driver_cls.retraction}; backup mode {backup_mode!r} is not driven "
                          f"(leave it unset, or one of {', '.join(driver_cls.backup_modes)})")
    return _built(driver_cls, config, backup_mode)


def _built(driver_cls, config: ModelConfig, backup_mode: str | None):
    """The server built; an error of the build that is the adapter meeting a reshaped release (a call that does not
    bind, a field SGLang reads of a stand-in: ``compat.drift``) is API CHANGED, not a startup crash found in SGLang."""
    with drift_raised(f"{driver_cls.label}'s build for config {config.name!r}"):
        return driver_cls(config, backup_mode=backup_mode)
