"""The machine a config's server runs on (a GPU, or a CPU server's Xeon), stood in for while SGLang resolves its flags
and builds its pools here.

A server's flags are resolved against its machine: FP4 KV, ``mxfp8`` and the mamba extra buffer need a CUDA GPU
(``mxfp8`` a Blackwell one), and DeepSeek DSA's model hook asks the GPU's compute capability. On a machine without
one, SGLang's base platform refuses them, so the pools fuzzed would be a CPU server's, not the GPU server's a user
runs. ``gpu_server`` answers those questions as the GPU would, for the span of one build, and nothing else:

- the platform facts every hook reads, through SGLang's own ``override_platform`` (its scoped seam for this); before
  0.5.19 (0.5.18 and before), which has no such seam, through every module's binding of the ``utils.common`` probe that
  answers each fact
  (``_stated_by_bindings``: the same facts, the same span, restored after);
- SGLang's call-time CUDA probe ``utils.common.is_cuda`` (``is_float4_e2m1fn_x2`` asks it before building the FP4
  quant method);
- ``torch.cuda.get_device_capability``, which the DSA model hook calls for a value it does not use;
- the GPU's memory as the memory hook asks it (``get_nvgpu_memory_capacity``; the pool sizes come from the flags'
  caps and the configurator's fixed budget, not from it).

Names bound at import (``_is_cuda = is_cuda()`` in the kernels' modules) keep the CPU's answer: the kernels that run
are the CPU's, the decisions are the GPU server's. So that a module a build imports first does not bind the GPU's
answer, the modules that bind the device module at import (``DEVICE_BOUND_MODULES``: a host tier's events and
streams come from it) are imported on this machine before a GPU is stood in for.

A CPU server (SGLang's CPU FP8 KV cache is one's) runs SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) on an x86
Xeon with AMX, which that KV cache requires. ``cpu_server`` answers as that machine, for the span of one build: the
platform facts (``has_amx``: the flags resolve to its ``intel_amx`` attention backend, as ``handle_cpu_backends``
picks it), and the KV cache configurator's own platform (SGLang's ``CpuSRTPlatform``, which this process did not
resolve at import) and AMX probe, which decide its CPU FP8 checks and quant method. The kernels that run are this
machine's.

Every name read here is private to SGLang and listed in ``compat.needs.PRIVATE``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

from poolfuzz.adapters.sglang.compat.drift import platform_refused
from poolfuzz.adapters.sglang.compat.needs import has_private, private, private_module, private_name


# SGLang modules that bind ``device_module = get_device_module()`` at import. A PD decode server's pools, built under
# the GPU's stand-in, import the HiCache controller; bound to torch.cuda there, a later CPU host tier in the process
# asked CUDA for its events ("Tried to instantiate dummy base class Event").
DEVICE_BOUND_MODULES = ("sglang.srt.managers.cache_controller", "sglang.srt.mem_cache.l2_transfer",
                        "sglang.srt.mem_cache.unified_cache.unified_cache_linker")


def _bound_on_this_machine(names: tuple[str, ...] = DEVICE_BOUND_MODULES) -> None:
    """Import ``names`` (those this release has) while SGLang still answers as this machine."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # a release without the module
            pass


@dataclass(frozen=True, kw_only=True)
class GPU:
    """A GPU as SGLang's platform facts name it."""

    name: str
    capability: tuple[int, int]
    memory_mib: int

    def facts(self) -> dict:
        """SGLang's platform facts (``runtime_context._PLATFORM_PROBES``) for this GPU."""
        major, minor = self.capability
        sm = major * 10 + minor
        return {"is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False,
                "is_mps": False, "is_sm90": sm == 90, "is_sm100": sm == 100, "is_sm100_or_sm110": sm in (100, 110),
                "is_sm110": sm == 110, "is_sm120": sm == 120, "is_blackwell": major in (10, 11, 12),
                "is_hopper_with_cuda_12_3": sm == 90, "has_amx": False, "device_sm": sm,
                "device_capability": self.capability}


# The GPU servers stand on: a Blackwell B200, where every KV dtype SGLang offers (FP4, mxfp8) is served.
B200 = GPU(name="B200", capability=(10, 0), memory_mib=183_359)
# SGLang's own seam for the facts (0.5.19 on), and the facts it takes
_OVERRIDE_NEEDS = ("override_platform", "platform_probes", "platform_values")
_NEEDS = (*_OVERRIDE_NEEDS, "cuda_probe", "gpu_memory_capacity")


# Before 0.5.19 (no ``override_platform``): SGLang's probes in ``utils.common`` each fact is read through (the names
# ``runtime_context._PLATFORM_PROBES`` and ``_PLATFORM_VALUES`` give them from 0.5.19), bound by name in every module
# that reads them (0.5.18: some 350 bindings in 126 modules once a build's modules are imported).
_PROBES = {"is_cuda": "is_cuda", "is_hip": "is_hip", "is_npu": "is_npu", "is_xpu": "is_xpu", "is_musa": "is_musa",
           "is_mps": "is_mps", "is_sm90": "is_sm90_supported", "is_sm100": "is_sm100_supported",
           "is_sm100_or_sm110": "is_sm100_or_sm110_supported", "is_sm110": "is_sm110_supported",
           "is_sm120": "is_sm120_supported", "is_blackwell": "is_blackwell_supported",
           "is_hopper_with_cuda_12_3": "is_hopper_with_cuda_12_3", "has_amx": "cpu_has_amx_support",
           "device_sm": "get_device_sm", "device_capability": "get_device_capability"}
_BOUND_NEEDS = ("cuda_probe", "gpu_memory_capacity")


# The modules a build first imports while a GPU is stood in for (0.5.12 to 0.5.18, every named config built): each
# was read for what it computes at import (FLA's kernels ask Triton's driver, not SGLang's probes; the argument hooks and the
# mamba checkpoint pool compute nothing), and is imported on this machine before the bindings are stated, so that
# ``_stated_by_bindings`` can refuse a build that imports any other under the stand-in.
IMPORTED_BEFORE_BINDINGS = ("sglang.srt.arg_groups.overrides", "sglang.srt.arg_groups.hisparse_hook",
                            "sglang.srt.arg_groups.kimi_k3_hook", "sglang.srt.arg_groups.pd_disaggregation_hook",
                            "sglang.srt.arg_groups.speculative_hook", "sglang.srt.mem_cache.mamba_checkpoint_pool",
                            "sglang.kernels.ops.attention.fla.chunk_delta_h", "sglang.kernels.ops.attention.fla.index",
                            "sglang.kernels.ops.attention.fla.op")


def platform_problem() -> str | None:
    """Why a GPU server cannot be stood in for on this release, or None."""
    return _lacking(_NEEDS) if has_private("override_platform") else _lacking(_BOUND_NEEDS)


def _lacking(needs: tuple[str, ...]) -> str | None:
    missing = [k for k in needs if not has_private(k)]
    return f"this release lacks {', '.join(missing)}" if missing else None


@contextlib.contextmanager
def _stated(facts: dict):
    """SGLang's platform facts stated for every reader through its own ``override_platform``, restored after; before
    0.5.19, through every binding of the probes that answer them (``_stated_by_bindings``)."""
    if not has_private("override_platform"):
        with _stated_by_bindings(facts):
            yield
        return
    # the facts this release reads (it refuses others: a GPU's facts name every release's)
    known = set(private("platform_probes")) | set(private("platform_values"))
    stated = {k: v for k, v in facts.items() if k in known}
    try:
        override = private("override_platform")(**stated)
        override.install()
    except Exception as exc:  # noqa: BLE001 -- SGLang's seam refusing the adapter's facts: the adapter's drift
        raise platform_refused(exc, stated) from None
    try:
        yield
    finally:
        override.restore()


def _sglang_modules() -> dict:
    """SGLang's imported modules by name."""
    import sys

    return {n: m for n, m in list(sys.modules.items()) if m is not None and (n == "sglang" or n.startswith("sglang."))}


@contextlib.contextmanager
def _stated_by_bindings(facts: dict):
    """A release before 0.5.19 reads each platform fact by calling a probe of ``utils.common`` bound by name in the
    module that reads it (``is_cuda()``, ``is_blackwell_supported()``, ``get_device_sm()``, ...): every such binding
    (the probe's own in ``utils.common`` among them, so SGLang's uncached helpers there, ``is_float4_e2m1fn_x2`` and
    ``get_device_memory_capacity``, ask it) answers the stated fact for the span of the ``with``, and is restored
    after, in modules imported meanwhile too. What a module computed from a probe when it was imported
    (``_is_cuda = is_cuda()``) and the probes SGLang caches on top of these (``is_cuda_alike``,
    ``is_flashinfer_available``) keep this machine's answer, as they do under ``override_platform``."""
    from sglang.srt.utils import common

    _bound_on_this_machine(IMPORTED_BEFORE_BINDINGS)  # a module imported under the stand-in keeps its answers
    before = set(_sglang_modules())
    probes = {fact: getattr(common, _PROBES[fact], None) for fact in facts if fact in _PROBES}
    fakes = {id(probe): (lambda v: lambda *a, **k: v)(facts[fact]) for fact, probe in probes.items() if probe}
    originals = {id(fakes[id(probe)]): probe for probe in probes.values() if probe}

    def rebind(table):  # every binding of a key's object, in every SGLang module, to the table's value
        for module in _sglang_modules().values():
            space = vars(module)
            for name, value in list(space.items()):
                if id(value) in table:
                    space[name] = table[id(value)]

    rebind(fakes)
    try:
        yield
    finally:
        rebind(originals)
    imported = sorted(set(_sglang_modules()) - before)
    if imported:  # what they computed from a probe at import is the GPU's, for good: the build is not this machine's
        raise RuntimeError(f"SGLang modules were first imported while a GPU was stood in for ({', '.join(imported)}), "
                           "and may keep its answers: add them to compat.platform.IMPORTED_BEFORE_BINDINGS")


@contextlib.contextmanager
def gpu_server(gpu: GPU):
    """SGLang answering as a server on ``gpu`` for the span of the ``with`` (see the module docstring)."""
    import torch

    _bound_on_this_machine()
    probe = private("cuda_probe")
    common = __import__(probe.__module__, fromlist=["_"])
    with _stated(gpu.facts()), mock.patch.object(common, private_name("cuda_probe"), lambda: True), \
            mock.patch.object(common, private_name("gpu_memory_capacity"), lambda: gpu.memory_mib), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: gpu.capability):
        yield gpu


@dataclass(frozen=True, kw_only=True)
class CPU:
    """A CPU server's machine as SGLang's platform facts name it."""

    name: str
    amx: bool

    def facts(self) -> dict:
        """SGLang's platform facts for this CPU (no accelerator)."""
        return {"is_cuda": False, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False,
                "is_mps": False, "has_amx": self.amx}


# The CPU servers stand on: a Sapphire Rapids Xeon, whose AMX tiles SGLang's CPU FP8 KV cache requires.
XEON = CPU(name="Xeon (Sapphire Rapids)", amx=True)
_CPU_NEEDS = ("configurator_platform", "configurator_amx_probe", "cpu_platform")


def cpu_platform_problem() -> str | None:
    """Why a CPU server's machine cannot be stood in for on this release, or None."""
    return _lacking((*_OVERRIDE_NEEDS, *_CPU_NEEDS) if has_private("override_platform") else _CPU_NEEDS)


@contextlib.contextmanager
def cpu_server(cpu: CPU):
    """SGLang answering as a CPU server on ``cpu`` for the span of the ``with`` (see the module docstring)."""
    configurator = private_module("configurator_platform")
    with _stated(cpu.facts()), \
            mock.patch.object(configurator, private_name("configurator_platform"), private("cpu_platform")()), \
            mock.patch.object(configurator, private_name("configurator_amx_probe"), lambda: cpu.amx):
        yield cpu
