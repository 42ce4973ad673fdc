"""Drive vLLM (installed from PyPI) with the poolfuzz harness: its own Scheduler, or its KV cache manager directly.

``--family vllm`` runs vLLM's own ``Scheduler`` (``scheduling.py``): it decides chunks, prefix hits, preemption,
speculative drafts' acceptance, KV connector loads and saves, and blocks; a worker stand-in (``worker.py``)
checks every attended position and recurrent state. ``vllm:scheduler`` is the same family under the name it
had for one release.

``--family vllm:manager`` drives vLLM's ``KVCacheManager`` directly (``family.py``, ``protocol.py``), only for
what the scheduler path cannot reach: multi-turn requests continued on a finished request's blocks, EAGLE's
hit truncation, a connector on a hybrid model before 0.34 (on 0.34 the scheduler path runs the store's
connector on hybrids, ``connector.hybrid_capable``) and its offload of a preempted request's blocks, the #44409
anchor, and the fault catalogue's two-node programs. The harness
chooses the calls (chunk sizes within a budget, which request is preempted, when a next turn arrives), as any
caller of the manager may; what vLLM's scheduler decides it asks vLLM: where an "align" prefill chunk ends is
``Scheduler._mamba_block_aligned_split`` on a server of the config (``scheduling.align_splitter``). One rule is
restated, because it sits inline in ``Scheduler.schedule()`` with no function below it to call: a connector's
hit strictly past a local hit's tail inside a block truncates that tail (``protocol._lookup``); on 0.34 the
scheduler path runs that rule itself (the store's connector on an align hybrid), so the restatement is due to go.
Importing this module does not import vLLM; building a family does.
"""

from __future__ import annotations


def build_manager_family(config, *, device="cpu", faults=(), backup_mode=None):
    """The family factory registered as ``vllm:manager``: vLLM's KVCacheManager, driven call by call."""
    from poolfuzz.adapters.vllm.family import build_vllm_family
    from poolfuzz.adapters.vllm.scheduling import align_splitter

    return build_vllm_family(config, device=device, faults=faults, backup_mode=backup_mode,
                             align_splitter=align_splitter)


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


build_manager_family.unsupported_reason = unsupported_reason
# What ``poolfuzz doctor`` prints and ``poolfuzz run`` checks before fuzzing (adapters/vllm/compat.py).
build_manager_family.engine_report = engine_report
# Its families continue finished requests (``VllmFamily.supports_next_turn``): the machine gets the rule.
build_manager_family.supports_next_turn = True
# The source that is "the engine" for coverage: vLLM's v1 KV cache management, relative to site-packages.
build_manager_family.engine_code = ("vllm/v1/core",)


def build_scheduler_driver(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``vllm`` (and ``vllm:scheduler``): one example's server (vLLM's Scheduler and the worker
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
