"""Drive SGLang's real memory pools and scheduler, installed from PyPI, with the poolfuzz harness.

``poolfuzz run --family sglang`` (a suite, ``orchestration/plugins.SUITES``) runs each config through SGLang's own
servers: ``sglang:scheduler``, ``sglang:hicache``, ``sglang:decode``, and ``sglang:unified-server`` and
``sglang:unified-decode`` on the unified memory pool (``scheduler/``, ``unified_pool/``), each over the pools SGLang's
own configurator builds for that server (``pools/``). Importing this module does not import SGLang; building a
server does (behind the CPU import shims in :mod:`.shims`).
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.pools.server_models import model_shaped


def describe() -> dict:
    """The installed SGLang and what the adapter found in it (for reports and the compat table)."""
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.host_tier.host import host_pool_path_present

    api = load()
    return {"host_pool_backup": host_pool_path_present(), "version": api.version, "shims": api.shims, "kv_on_req": api.kv_on_req,
            "mamba_slot_allocator": api.MambaSlotAllocator is not None,
            "declares_cpu_copy_carries_mamba": api.kv_pools_declare_mamba,
            "row_alloc_takes_reqs": api.row_alloc_takes_reqs,
            "paged_kernels": list(api.paged_kernels), "kernels_interpreted": api.kernels_interpreted}


def engine_report():
    """The installed SGLang and every class and function the families need of it, probed (``poolfuzz doctor``)."""
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.compat import engine_report as probed
    from poolfuzz.errors import EngineApiChanged

    try:
        load()  # SGLang imported behind the CPU shims (a ConfigError naming the fix where it is not installed)
    except EngineApiChanged:
        pass  # the probes name it
    return probed()


def _described(config, *, build, decline, role_flags=None, notes=()):
    """The scheduler-path server ``build(config)`` starts: every flag it runs with (its pools' flags and its own:
    chunked prefill, running cap, role; the driver's ``listed_flags``), what SGLang's configurator builds for the
    config's server with ``role_flags``, and the pools that server runs on (``poolfuzz configs --family F``).
    ``decline``: the family's decline check, asked first, as a run asks it."""
    import shlex

    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.pools.descriptions import DRAFT, describe_pools
    from poolfuzz.adapters.sglang.pools.environment import server_environment
    from poolfuzz.adapters.sglang.pools.configurator import (CONFIGURATOR, builder, command_line, configure,
                                                             server_flags, server_model)
    from poolfuzz.errors import ConfigError, EngineApiChanged
    from poolfuzz.pools.capabilities import ServerDescription

    load()
    flags = command_line(server_flags(config) | (role_flags or {}))
    built, refused, family, declines, crashes, model = None, None, None, None, None, None
    served = config  # the config as the family sizes its server (a scheduler path's mamba cache among it)
    try:
        if why := decline(config):
            raise ConfigError(why)
        driver = build(config)
        built_family, served = driver.family, driver.family.config
        flags = command_line(server_flags(served) | driver.listed_flags | (role_flags or {}))
        family = describe_pools(built_family.sg_req_pool, built_family.sg_kv_pool, built_family.sg_allocator)
    except ConfigError as exc:
        declines = str(exc)
    except EngineApiChanged:
        raise  # the adapter meets a reshaped release: `poolfuzz configs` says API CHANGED, as a run does
    except Exception as exc:  # SGLang's own startup raised (0.5.11's FP4 decode server): a finding, listed as one
        crashes = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        server = server_model(served)
        model = server.hf_config
        built = configure(served, role_flags=role_flags).parts()
    except ConfigError as exc:
        refused = str(exc)
    except EngineApiChanged:
        if declines is None:
            raise
        # a server of a mode the release lacks (--enable-unified-memory before 0.5.15): the family's reason says so
        refused = declines
    if config.free_memory_kib:  # what no flag says: the sizes above are SGLang's answer to this much memory
        notes = (*notes, f"sized by {builder()} from {config.free_memory_kib} KiB of device memory free once "
                         "the weights are loaded (no --max-total-tokens, --max-mamba-cache-size or "
                         "--swa-full-tokens-ratio named)")
    # a server with the model's shapes and random weights: the pools poolfuzz fuzzed, on a GPU
    environment = " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(server_environment(served).items()))
    return ServerDescription(flags=flags, built=built, refused=refused, family=family, family_declines=declines,
                             family_crashes=crashes,
                             environment=environment,
                             model=model, launcher="python -m sglang.launch_server --load-format dummy "
                                                   "--skip-tokenizer-init", notes=tuple(notes),
                             unfuzzed=(DRAFT,) if built and DRAFT in built else (),
                             built_by="configurator" if builder() == CONFIGURATOR else "model runner")


def build_unified_server(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``sglang:unified-server``: one example's server started with
    ``--enable-unified-memory``, SGLang's Scheduler over the unified memory pool its configurator builds, fed by the
    model-runner stand-in (``scheduler/unified_server.UnifiedServerDriver``)."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import build_unified_driver

    return build_unified_driver(config, device=device, faults=faults, backup_mode=backup_mode)


def unified_server_unsupported_reason(config) -> str | None:
    """Why the unified-memory server does not drive ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import unsupported_reason as probe

    return probe(config)


def describe_unified_driver(config):
    """The unified-memory server's listing: its flags, what SGLang's configurator builds, the pools it runs on."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import build_unified_driver
    from poolfuzz.adapters.sglang.unified_pool.unified import SERVER_FLAGS

    return _described(config, build=build_unified_driver, role_flags=SERVER_FLAGS,
                             decline=unified_server_unsupported_reason)


def describe_scheduler_server(config):
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    return _described(config, build=build_driver, decline=scheduler_unsupported_reason)


def describe_decode_server(config):
    """The decode server's listing; where it is started with the backup an operator adds after SGLang refuses the one
    it resolves (``decode_server.operator_backup``), a note says so, with SGLang's refusal."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import (ROLE_FLAGS, SglangDecodeDriver, build_decode_driver,
                                                                  decode_problem, operator_backup)
    from poolfuzz.adapters.sglang.scheduler.servers import server_refusal

    notes = []
    if decode_problem(config) is None and (added := operator_backup(config)):
        notes.append(f"started with --disaggregation-decode-retraction-backup {added}, as an operator would: SGLang "
                     f"refuses the server it resolves without the flag ({server_refusal(config, SglangDecodeDriver, None)})")
    return _described(config, build=build_decode_driver, role_flags=ROLE_FLAGS, notes=notes,
                             decline=decode_unsupported_reason)


def describe_hicache_server(config):
    """The HiCache server's listing (its tier flags among its ``listed_flags``)."""
    from poolfuzz.adapters.sglang.scheduler.hicache_server import build_hicache_driver

    def build(c):
        driver = build_hicache_driver(c)
        driver.close()  # its pools are read after; its storage threads and files are not needed
        return driver

    return _described(config, build=build, decline=hicache_unsupported_reason)


def build_scheduler_driver(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``sglang:scheduler``: one example's server, SGLang's own Scheduler methods and
    result processor over the family's pools and radix tree, fed by a model-runner stand-in
    (``scheduling.SglangSchedulerDriver``), driven by ``harness/scheduled.py``'s machine."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    return build_driver(config, device=device, faults=faults, backup_mode=backup_mode)


def scheduler_unsupported_reason(config) -> str | None:
    """Why the scheduler path does not drive ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as probe

    return probe(config)


build_scheduler_driver.drives_scheduler = True
build_scheduler_driver.takes_drawn_configs = True  # drawn models: SGLang's server refuses what it does not build
build_scheduler_driver.describe_server = describe_scheduler_server  # poolfuzz configs --family: the server's flags and pools
build_scheduler_driver.unsupported_reason = scheduler_unsupported_reason
build_scheduler_driver.model_shaped = model_shaped  # drawn models laid out as the model SGLang serves for their layers
build_scheduler_driver.engine_report = engine_report
# What --coverage measures: the scheduler's batch and policy code, and the pools and caches below it.
build_scheduler_driver.engine_code = ("sglang/srt/mem_cache", "sglang/srt/managers/schedule_batch.py",
                                      "sglang/srt/managers/schedule_policy.py", "sglang/srt/managers/scheduler.py",
                                      "sglang/srt/managers/scheduler_components")


def decode_shaped(config):
    """A drawn config as a decode server serves it (``scheduler/decode_server.decode_shaped``)."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import decode_shaped as shaped

    return shaped(config)


def build_decode_driver(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``sglang:decode``: one example's PD decode server, SGLang's own decode queues
    (pre-allocation, transfer, retraction with a KV backup and its restore) and Scheduler over the family's pools,
    fed by a prefill stand-in and the model-runner stand-in (``decode_server.SglangDecodeDriver``)."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import build_decode_driver as build

    return build(config, device=device, faults=faults, backup_mode=backup_mode)


def decode_unsupported_reason(config, *, backup_mode=None) -> str | None:
    """Why the decode server (with the run's ``--backup-mode``; unset, the one SGLang resolves) does not drive
    ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import unsupported_reason as probe

    return probe(config, backup_mode=backup_mode)


build_decode_driver.drives_scheduler = True
build_decode_driver.takes_drawn_configs = True  # drawn models: SGLang's server refuses what it does not build
build_decode_driver.describe_server = describe_decode_server  # poolfuzz configs --family: the server's flags and pools
build_decode_driver.unsupported_reason = decode_unsupported_reason
build_decode_driver.model_shaped = decode_shaped  # as a decode server serves them: no extra-buffer track slots
build_decode_driver.declines_by_backup_mode = True  # a named backup refuses what SGLang's resolution would not
build_decode_driver.engine_report = engine_report
# What --coverage measures: the decode side's queues besides the scheduler path's files.
build_decode_driver.engine_code = build_scheduler_driver.engine_code + (
    "sglang/srt/disaggregation/decode.py", "sglang/srt/disaggregation/decode_schedule_batch_mixin.py")


def build_hicache_driver(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``sglang:hicache``: one example's server started with
    ``--enable-hierarchical-cache``, SGLang's Scheduler over a radix tree with a host tier (write-through, eviction
    to the host, load-back by the prefill adder), fed by the model-runner stand-in
    (``hicache_server.SglangHiCacheDriver``)."""
    from poolfuzz.adapters.sglang.scheduler.hicache_server import build_hicache_driver as build

    return build(config, device=device, faults=faults, backup_mode=backup_mode)


def hicache_unsupported_reason(config) -> str | None:
    """Why the HiCache server does not drive ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang.scheduler.hicache_server import unsupported_reason as probe

    return probe(config)


build_hicache_driver.drives_scheduler = True
build_hicache_driver.takes_drawn_configs = True  # drawn models: SGLang's server refuses what it does not build
build_hicache_driver.describe_server = describe_hicache_server  # poolfuzz configs --family: the server's flags and pools
build_hicache_driver.unsupported_reason = hicache_unsupported_reason
build_hicache_driver.model_shaped = model_shaped  # drawn models laid out as the model SGLang serves for their layers
build_hicache_driver.engine_report = engine_report
# What --coverage measures: the scheduler path's files (the host pools and cache controller are under mem_cache),
# and the legacy controller the unified one builds on.
build_hicache_driver.engine_code = build_scheduler_driver.engine_code + ("sglang/srt/managers/cache_controller.py",)


def build_unified_decode(config, *, device="cpu", faults=(), backup_mode=None):
    """The factory registered as ``sglang:unified-decode``: one example's PD decode server started with
    ``--enable-unified-memory`` (``scheduler/unified_server.UnifiedDecodeDriver``)."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import build_unified_decode_driver

    return build_unified_decode_driver(config, device=device, faults=faults, backup_mode=backup_mode)


def unified_decode_unsupported_reason(config) -> str | None:
    """Why the unified-memory decode server does not drive ``config`` with the installed SGLang, or None."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import decode_unsupported_reason as probe

    return probe(config)


def describe_unified_decode(config):
    """The unified-memory decode server's listing: its flags, what SGLang's configurator builds, its pools."""
    from poolfuzz.adapters.sglang.scheduler.unified_server import UnifiedDecodeDriver, build_unified_decode_driver

    return _described(config, build=build_unified_decode_driver, role_flags=UnifiedDecodeDriver.pool_flags,
                             decline=unified_decode_unsupported_reason)


build_unified_server.drives_scheduler = True
build_unified_server.takes_drawn_configs = True  # drawn models: SGLang's server refuses what it does not build
build_unified_server.describe_server = describe_unified_driver
build_unified_server.unsupported_reason = unified_server_unsupported_reason
build_unified_server.model_shaped = model_shaped  # drawn models laid out as the model SGLang serves for their layers
build_unified_server.engine_report = engine_report
build_unified_server.engine_code = build_scheduler_driver.engine_code

build_unified_decode.drives_scheduler = True
build_unified_decode.takes_drawn_configs = True
build_unified_decode.describe_server = describe_unified_decode
build_unified_decode.unsupported_reason = unified_decode_unsupported_reason
build_unified_decode.model_shaped = decode_shaped  # as a decode server serves them: no extra-buffer track slots
build_unified_decode.engine_report = engine_report
build_unified_decode.engine_code = build_decode_driver.engine_code
