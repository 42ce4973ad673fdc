"""Drive vLLM's real v1 KV cache manager (installed from PyPI) with the poolfuzz harness.

Two families: ``vllm:scheduler`` runs vLLM's own ``Scheduler`` (``scheduling.py``: it decides chunks, hits,
preemption and blocks; a worker stand-in checks every attended position), ``vllm`` plays the scheduler itself
over the manager (it reaches what the scheduler path does not drive yet: speculative decoding, next turns, KV
connectors, the events).

``poolfuzz run --family vllm`` builds vLLM's own ``KVCacheManager`` for a config (full attention,
sliding window and mamba groups over one block pool, prefix caching on) with real ``Request``
objects, and models the worker's side: the KV tensors, the writes into the blocks the manager hands
out, recompute after preemption. Importing this module does not import vLLM; building a family does.
"""

from __future__ import annotations


def build_family(config, *, device="cpu", faults=(), backup_mode=None):
    """The family factory registered as ``vllm`` in the ``poolfuzz.families`` entry points."""
    from poolfuzz.adapters.vllm.family import build_vllm_family

    return build_vllm_family(config, device=device, faults=faults, backup_mode=backup_mode)


def unsupported_reason(config) -> str | None:
    """Why the installed vLLM cannot run ``config`` here, or None."""
    from poolfuzz.adapters.vllm.family import unsupported_reason as probe

    return probe(config)


def describe() -> dict:
    """The installed vLLM and what the adapter found in it (for reports and the compat table)."""
    from poolfuzz.adapters.vllm.api import load

    api = load()
    return {"version": api.version, "mamba_cache_modes": list(api.mamba_cache_modes),
            "external_tokens": api.takes_external_tokens}


def engine_report():
    """The installed vLLM and every entry point the family needs of it, probed (``poolfuzz doctor``)."""
    from poolfuzz.adapters.vllm.compat import engine_report as probed

    return probed()


build_family.unsupported_reason = unsupported_reason
# What ``poolfuzz doctor`` prints and ``poolfuzz run`` checks before fuzzing (adapters/vllm/compat.py).
build_family.engine_report = engine_report
# Its families continue finished requests (``VllmFamily.supports_next_turn``): the machine gets the rule.
build_family.supports_next_turn = True
# The source that is "the engine" for coverage: vLLM's v1 KV cache management, relative to site-packages.
build_family.engine_code = ("vllm/v1/core",)


def build_scheduler_driver(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``vllm:scheduler``: one example's server (vLLM's Scheduler and the worker
    stand-in, ``scheduling.SchedulerDriver``), driven by ``harness/scheduled.py``'s machine."""
    from poolfuzz.adapters.vllm.scheduling import build_driver

    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode)


def scheduler_unsupported_reason(config) -> str | None:
    """Why the scheduler path does not drive ``config`` with the installed vLLM, or None."""
    from poolfuzz.adapters.vllm.scheduling import unsupported_reason as probe

    return probe(config)


def scheduler_engine_report():
    """The installed vLLM and every entry point the scheduler path needs of it (the scheduler's ones required)."""
    from poolfuzz.adapters.vllm.compat import scheduler_engine_report as probed

    return probed()


build_scheduler_driver.drives_scheduler = True
build_scheduler_driver.unsupported_reason = scheduler_unsupported_reason
build_scheduler_driver.engine_report = scheduler_engine_report
# What --coverage measures: the scheduler and the KV cache management below it.
build_scheduler_driver.engine_code = ("vllm/v1/core",)
