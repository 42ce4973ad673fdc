"""What the installed SGLang offers, found by feature detection, never by version strings.

Releases 0.5.9 to 0.5.23 drift: the allocators moved into ``mem_cache/allocator/`` (and mamba
slot allocation was split out into ``MambaSlotAllocator``) in 0.5.13; the request's KV fields
moved under ``req.kv`` (a ``ReqKvInfo``) in 0.5.19; constructor keywords come and go. Each
difference is probed here once: try-imports for where a class lives, signature inspection for
which keywords a callable takes, attribute probes for how an object stores its state.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from poolfuzz.errors import EngineApiChanged
from poolfuzz.pools.errors import ConfigError

INSTALL_HINT = ("install it beside poolfuzz (see the README section 'Driving real SGLang pools': "
                "pip install 'poolfuzz[sglang]' with the CPU recipe)")


class SGLangUnavailable(ConfigError):
    """SGLang is not installed here, or lacks something the adapter cannot do without."""


@contextmanager
def switched_on(variable: str):
    """One of SGLang's environment switches set to "1" for the span of the block, and put back as it was after."""
    before = os.environ.get(variable)
    os.environ[variable] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before


def first_importable(*candidates: str, required: bool = True) -> Any:
    """The first ``module:attr`` that imports; None (or an error naming all tried) otherwise."""
    tried = []
    for target in candidates:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            tried.append(f"{target} ({exc})")
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
        tried.append(f"{target} (no such attribute)")
    if required:
        raise SGLangUnavailable("this SGLang has none of: " + "; ".join(tried))
    return None


_SIGNATURES: dict[tuple, inspect.Signature] = {}


def parameters(fn: Callable):
    """``inspect.signature(fn).parameters``, computed once per function (a bound method's is its
    function's, less the instance): the adapter asks on every allocation, free and eviction."""
    key = (getattr(fn, "__func__", fn), hasattr(fn, "__func__"))
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(fn)
    return sig.parameters


def accepted_kwargs(fn: Callable, **kwargs) -> dict:
    """The subset of ``kwargs`` that ``fn`` names as parameters (``**kwargs`` sinks are not used)."""
    params = parameters(fn)
    return {k: v for k, v in kwargs.items() if k in params}


def call_with(fn: Callable, /, **kwargs):
    """Call ``fn`` with the keywords it names; a required one we cannot supply is a clear error."""
    params = parameters(fn)
    missing = [n for n, p in params.items()
               if n != "self" and p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise SGLangUnavailable(f"{name} requires {', '.join(missing)}, which the adapter does not know how to give")
    return fn(**accepted_kwargs(fn, **kwargs))


def construct(cls: type, **kwargs):
    return call_with(cls, **kwargs)


@dataclass(frozen=True)
class SGLangAPI:
    """The classes and functions of the installed SGLang that the adapter drives."""

    version: str
    shims: dict
    ReqToTokenPool: type
    HybridReqToTokenPool: type
    MambaPool: type
    MHATokenToKVPool: type
    HybridLinearKVPool: type
    SWAKVPool: type
    TokenToKVPoolAllocator: type
    PagedTokenToKVPoolAllocator: type
    SWATokenToKVPoolAllocator: type
    MambaSlotAllocator: type | None  # None: slots are allocated by the MambaPool itself
    Req: type
    ReqKvInfo: type | None  # None: the request's KV fields are flat on the Req
    # Pool classes that store KV other than as K and V rows (None where the release has none)
    MLATokenToKVPool: type | None = None
    DSATokenToKVPool: type | None = None  # NSATokenToKVPool before the rename
    MHATokenToKVPoolMXFP8: type | None = None
    # The allocator of an all-SWA model (every layer sliding-window; None where the release has none)
    PureSWATokenToKVPoolAllocator: type | None = None
    get_parallel: Callable | None = None  # the runtime's parallel context, where pools read it

    @property
    def kv_on_req(self) -> bool:
        """True where the Req keeps its KV fields on ``req.kv`` (a ``ReqKvInfo`` with a row field;
        some releases have a smaller ``ReqKvInfo`` that is not the request's KV record)."""
        return self.ReqKvInfo is not None and "req_pool_idx" in parameters(self.ReqKvInfo)

    @property
    def row_alloc_takes_reqs(self) -> bool:
        """``ReqToTokenPool.alloc(reqs)`` binds rows to requests; older ones take a count."""
        return "reqs" in parameters(self.ReqToTokenPool.alloc)

    @property
    def paged_kernels(self) -> tuple[str, ...]:
        """The Triton kernels the paged allocator's ``alloc_extend`` / ``alloc_decode`` name (empty: torch
        code only, or the kernels are plain functions under the triton stand-in)."""
        import sys

        cls = self.PagedTokenToKVPoolAllocator
        module = sys.modules.get(cls.__module__)
        names = set()
        for method in ("alloc_extend", "alloc_decode"):
            code = getattr(getattr(cls, method, None), "__code__", None)
            names.update(code.co_names if code is not None else ())
        return tuple(sorted(n for n in names if type(getattr(module, n, None)).__module__.startswith("triton.")))

    @property
    def kernels_interpreted(self) -> bool:
        """Triton kernels run on the CPU, in Triton's interpreter (the real wheel and no GPU; see shims)."""
        return self.shims.get("triton") == "interpreter"

    @property
    def kv_pools_declare_mamba(self) -> bool:
        """Whether the KV pools declare ``cpu_copy_carries_mamba`` (SGLang's #35957 fix)."""
        return any("cpu_copy_carries_mamba" in vars(c) for c in self.HybridLinearKVPool.__mro__)


@lru_cache(maxsize=1)
def load() -> SGLangAPI:
    """Import SGLang (behind the CPU shims) and probe what it offers. Cached per process.

    The import runs on a thread of its own: SGLang's modules keep exceptions they caught while importing
    (``torch_memory_saver_adapter`` keeps its ``ModuleNotFoundError``), and a kept traceback holds every frame
    under it. Imported from inside an example (the first family a fuzz builds), those frames were the state
    machine's, and its engine and pools stayed in memory for the rest of the process."""
    outcome: dict = {}

    def importing() -> None:
        try:
            outcome["api"] = _load()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            outcome["error"] = exc

    thread = threading.Thread(target=importing, name="poolfuzz-import-sglang")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["api"]


def _load() -> SGLangAPI:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            sglang_version = version("sglang")
        except PackageNotFoundError:
            raise SGLangUnavailable(f"SGLang is not installed in this environment; {INSTALL_HINT}") from None
    except ImportError:  # pragma: no cover - Python < 3.8
        sglang_version = "unknown"
    from poolfuzz.adapters.sglang import shims

    shims.install()  # the stand-ins must be in sys.modules before the first sglang import
    logging.getLogger("sglang").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        # Importing SGLang on a CPU machine warns about CUDA-only quantization methods, and
        # its transitive imports raise deprecation warnings; none concern the pools.
        warnings.simplefilter("ignore")
        try:
            _import_with_on_demand_shims(shims)
            _import_lazy_modules()
            return _probe(sglang_version, shims.install())
        except (SGLangUnavailable, EngineApiChanged):
            raise
        except Exception as exc:
            raise SGLangUnavailable(
                f"SGLang {sglang_version} did not import here: {type(exc).__name__}: {exc}; {INSTALL_HINT}"
            ) from exc


# The modules whose import chains reach everything _probe reads.
_ENTRY_MODULES = ("sglang.srt.mem_cache.memory_pool", "sglang.srt.managers.schedule_batch")


# Modules the pools import inside their methods (``set_kv_buffer`` asks the model runner for the capture
# mode), imported here, on ``load``'s own thread, for the same reason: their chain keeps the exceptions it caught
# (DeepEP's dispatcher keeps its ``ModuleNotFoundError``), which would hold the frames of the first example's write.
_LAZY_MODULES = ("sglang.srt.model_executor.runner",)


def _import_lazy_modules() -> None:
    for module in _LAZY_MODULES:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a release without it, or whose chain fails here: the pools import it themselves
            pass


def _import_with_on_demand_shims(shims) -> None:
    """Import the entry modules; where one fails for want of a module that has an on-demand stand-in
    (``sgl_kernel``), put that in and retry (Python drops the modules whose import failed)."""
    for module in _ENTRY_MODULES:
        try:
            shims.import_module(module)
        except ImportError:
            pass  # _probe names what is missing


def _probe(sglang_version: str, installed: dict) -> SGLangAPI:
    """Every class and function of ``compat.NEEDS``, found where this release keeps it; a needed one
    that is nowhere is an EngineApiChanged naming it and every place tried."""
    from poolfuzz.adapters.engine_api import PRESENT, require
    from poolfuzz.adapters.sglang.compat import ENGINE, NEEDS

    probes = require(NEEDS.values(), engine=ENGINE, release=sglang_version)
    found = {name: p.value if p.status == PRESENT else None for name, p in zip(NEEDS, probes)}
    return SGLangAPI(version=sglang_version, shims=installed, **found)
