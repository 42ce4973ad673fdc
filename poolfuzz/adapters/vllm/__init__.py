"""Drive vLLM (installed from PyPI) with the poolfuzz harness: its own Scheduler, or its KV cache manager directly.

``--family vllm`` runs vLLM's own ``Scheduler`` (``scheduling.py``): it decides chunks, prefix hits, preemption,
speculative drafts' acceptance, KV connector loads and saves, and blocks; a worker stand-in (``worker.py``)
checks every attended position and recurrent state. ``vllm:scheduler`` is the same family under the name it
had for one release.

``--family vllm:manager`` drives vLLM's ``KVCacheManager`` directly (``family.py``, ``protocol.py``). The harness
chooses the calls (chunk sizes within a budget, when a request finishes, when a next turn arrives), as any caller
of the manager may; it restates no scheduler decision, so what only the scheduler decides is not driven here:
preemption (``supports_retract`` False), a KV connector's tokens (a lookup is ``get_computed_blocks`` alone), and
mamba cache mode "align" (declined, pointing to ``--family vllm``: where its prefill chunks end and which cached
state a request continues from are the scheduler's). What it still reaches that ``--family vllm`` cannot:

* a chat's next turn that continues a finished request's whole token list (its prompt and every sampled
  token), so its prefix hit covers the blocks filled while decoding; the scheduler path's requests share at
  most four pages of an earlier request's tokens;
* EAGLE's hit drop on ``dense`` (``use_eagle``; the scheduler path drafts as ngram does);
* call orders of the manager no scheduler step makes: a sliding-window eviction (``remove_skipped_blocks``) on
  its own, an idle node's ``reset_prefix_cache`` mid-run and then serving on (the scheduler path resets only
  when it drains);
* releases whose ``Scheduler`` the scheduler path cannot drive (``scheduling.release_problem``).

Importing this module does not import vLLM; building a family does.
"""

from __future__ import annotations


def build_manager_family(config, *, device="cpu", faults=(), backup_mode=None):
    """The family factory registered as ``vllm:manager``: vLLM's KVCacheManager, driven call by call."""
    from poolfuzz.adapters.vllm.family import build_vllm_family

    return build_vllm_family(config, device=device, faults=faults, backup_mode=backup_mode)


def unsupported_reason(config) -> str | None:
    """Why ``vllm:manager`` does not run ``config`` with the installed vLLM (align configs: run ``--family vllm``), or None."""
    from poolfuzz.adapters.vllm.family import manager_unsupported_reason as probe

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
