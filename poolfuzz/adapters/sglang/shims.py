"""Import stand-ins that let SGLang's memory pools import on a CPU-only machine.

Three of SGLang's unconditional imports cannot be satisfied there from PyPI alone:

* ``torchvision``: ``mem_cache/memory_pool.py`` imports ``sglang.srt.configs``, whose
  ``__init__`` imports every model config, and one chain reaches ``torchvision.transforms``.
  PyPI's torchvision wheels are CUDA-linked and fail to import beside a CPU torch. A
  permissive stand-in works; transformers reads ``InterpolationMode.NEAREST_EXACT`` from it,
  so that one enum is real.
* ``triton``: imported at module level by the pools. The real wheel imports fine on CPU and
  is used whenever it is installed; otherwise a permissive stand-in is put in its place
  (kernel definitions become plain functions and are never launched on the CPU paths). With the
  real wheel and no GPU, kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, read
  when a kernel is defined, so set before the first sglang import): releases whose paged
  allocator launches a kernel for every allocation then allocate pages on the CPU too.
* ``sgl_kernel``: imported at module level by some releases' pools (e.g. the host pool's
  transfer functions). Only when an import fails for want of it (:func:`install_on_demand`), a
  stand-in makes its names importable and raises if one is ever called.

One call-time stand-in: some releases' ``get_cpu_copy`` / ``load_cpu_copy`` (the retraction
backup) call ``torch.cuda.synchronize()`` unconditionally, which a torch without CUDA answers with
an AssertionError. For pools on the CPU, whose work is synchronous, that call has nothing to wait
for; :func:`cpu_synchronize` makes it a no-op for the duration of the call, and only where torch
has no usable CUDA (with CUDA it is left alone).

Nothing here edits SGLang: the stand-ins go into ``sys.modules`` (through a meta-path finder
for their submodules) before the first ``sglang`` import, and only for modules that are
missing or fail to import. :func:`install` is idempotent and returns what it did.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
from functools import lru_cache

from poolfuzz.pools.environment import environment_set

_INSTALLED: dict[str, str] = {}


class _Permissive(types.ModuleType):
    """A module whose every missing attribute is another permissive module or class.

    Called with one callable it returns it unchanged (``@triton.jit``); called otherwise it
    returns a pass-through decorator (``@triton.autotune(...)``). Capitalised names are
    classes, so code may subclass or annotate with them.
    """

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _StubFinder.for_name(name), is_package=True)
        self.__file__ = f"<poolfuzz stand-in for {name}>"

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if full in sys.modules:
            value = sys.modules[full]
        elif attr[:1].isupper():
            value = type(attr, (_StandInBase,), {"__module__": self.__name__})
        else:
            value = type(self)(full)
            sys.modules[full] = value
        setattr(self, attr, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    def __repr__(self) -> str:
        return f"<poolfuzz stand-in module {self.__name__!r}>"

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (_StandInBase,)


class _CallRaises(_Permissive):
    """A permissive stand-in whose functions are importable but raise when called: for a kernel
    library whose names are imported at module level but whose kernels the CPU paths must never
    run (a silent no-op there would corrupt what the harness checks)."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} was called, but it is poolfuzz's import-only stand-in "
                           "(the real kernel library is not installed or does not import here)")


def import_only(obj) -> bool:
    """Whether ``obj`` is a name of an import-only stand-in library (its call raises): a CPU copy may replace it."""
    return isinstance(obj, _CallRaises)


class _StandInBase:
    """Base for stand-in classes: accepts any construction, any attribute is a stand-in."""

    def __init__(self, *args, **kwargs):
        pass

    def __class_getitem__(cls, item):
        return cls


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``<root>`` and ``<root>.*`` imports from stand-ins for the roots it was given."""

    _roots: dict[str, type] = {}
    _instance: "_StubFinder | None" = None

    @classmethod
    def for_name(cls, name: str) -> "_StubFinder":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self._roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = sys.modules.get(spec.name)
        return module if module is not None else self._roots[spec.name.split(".")[0]](spec.name)

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def _stub_root(root: str, kind: type = _Permissive) -> types.ModuleType:
    _StubFinder._roots[root] = kind
    finder = _StubFinder.for_name(root)
    if finder not in sys.meta_path:
        sys.meta_path.insert(0, finder)
    module = kind(root)
    sys.modules[root] = module
    return module


def _importable(name: str) -> bool:
    """Whether ``name`` is installed and really imports; a failed import leaves no trace."""
    if name in sys.modules:
        return not isinstance(sys.modules[name], _Permissive)
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
        return True
    except Exception:  # a CUDA-linked wheel beside a CPU torch raises OSError/RuntimeError/...
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
        return False


class InterpolationMode(enum.Enum):
    """The one real piece of the torchvision stand-in: transformers reads its members."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _install_torchvision() -> str:
    if _importable("torchvision"):
        return "real"
    root = _stub_root("torchvision")
    root.__version__ = "0.0.0+poolfuzz.stand.in"
    transforms = importlib.import_module("torchvision.transforms")
    transforms.InterpolationMode = InterpolationMode
    functional = importlib.import_module("torchvision.transforms.functional")
    functional.InterpolationMode = InterpolationMode
    return "stand-in"


def _install_triton() -> str:
    interpreting = _interpret_kernels_without_gpu()  # before the first import: kernels are wrapped then
    if _importable("triton"):
        return "interpreter" if interpreting else "real"
    if interpreting is _SET_HERE:
        del os.environ["TRITON_INTERPRET"]
    root = _stub_root("triton")
    root.__version__ = "0.0.0"
    root.cdiv = lambda a, b: -(a // -b)
    root.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1
    language = importlib.import_module("triton.language")
    language.constexpr = type("constexpr", (_StandInBase,), {"__module__": "triton.language"})
    return "stand-in"


_SET_HERE = "set by poolfuzz"


def _interpret_kernels_without_gpu():
    """Where the real Triton wheel is installed and no GPU is visible, every kernel SGLang launches runs
    on the CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1``, which Triton reads as it wraps
    each kernel (its own standard library included), so it is set before triton is first imported.
    Returns ``_SET_HERE`` when set here, True when the user set it, a false value when kernels compile."""
    import torch

    if "TRITON_INTERPRET" in os.environ:
        return os.environ["TRITON_INTERPRET"] == "1"
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return _SET_HERE


def _install_sgl_kernel() -> str:
    """Some releases import ``sgl_kernel`` (CUDA kernels, not on PyPI for CPU) at module level on
    the pools' import chain, e.g. ``memory_pool_host`` imports the ``sgl_kernel.kvcacheio`` transfer
    functions that only the host-pool backup (not driven here) calls. The stand-in makes those
    names importable; calling one raises, so no kernel silently becomes a no-op."""
    if _importable("sgl_kernel"):
        return "real"
    _stub_root("sgl_kernel", _CallRaises)
    return "stand-in"


ON_DEMAND = {"sgl_kernel": _install_sgl_kernel}


def install() -> dict[str, str]:
    """Make ``torchvision`` and ``triton`` importable; returns ``{module: "real" | "stand-in"}``
    (plus any on-demand stand-in put in since, see :func:`install_on_demand`)."""
    if not _INSTALLED:
        _INSTALLED["torchvision"] = _install_torchvision()
        _INSTALLED["triton"] = _install_triton()
        if _INSTALLED["triton"] == "interpreter":  # a kernel's stray access is a GPU's fault, not a SIGSEGV here
            from poolfuzz.adapters.sglang import interpreter_bounds

            interpreter_bounds.install()
    return dict(_INSTALLED)


def install_on_demand(missing: str | None) -> bool:
    """After an import failed with ``ModuleNotFoundError(name=missing)``: put in the stand-in for
    that module if there is one and it is not in yet; True if one was put in (retry the import).
    On demand only, so releases that import without it never see a stand-in that a
    ``try: import sgl_kernel ... except ImportError`` fallback would mistake for the real one."""
    root = (missing or "").split(".")[0]
    if root not in ON_DEMAND or root in _INSTALLED:
        return False
    _INSTALLED[root] = ON_DEMAND[root]()
    return _INSTALLED[root] == "stand-in"


def import_module(name: str):
    """``importlib.import_module(name)``, putting in an on-demand stand-in (:func:`install_on_demand`) each time the
    import fails for want of one (0.5.12's host pools reach ``sgl_kernel`` on every chain)."""
    while True:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not install_on_demand(exc.name):
                raise


def _no_sync(device=None) -> None:
    """``torch.cuda.synchronize`` for CPU pools on a torch without CUDA: nothing to wait for."""


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """Within the block, ``owner.name`` is ``value``; the real one is put back however the block ends."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def cpu_synchronize(device):
    """Within the block, ``torch.cuda.synchronize()`` is a no-op if the pools live on the CPU and
    this torch has no usable CUDA (where SGLang calls it unconditionally; see the module docstring)."""
    import torch

    if torch.device(device).type != "cpu" or torch.cuda.is_available():
        return contextlib.nullcontext()
    return swapped(torch.cuda, "synchronize", _no_sync)


def _unpinned(tensor, *args, **kwargs):
    """``Tensor.pin_memory`` where no accelerator exists: the CPU tensor itself (nothing to pin it for)."""
    return tensor


def cpu_pin_memory():
    """Within the block, pinned memory is plain CPU memory where this machine has no accelerator (torch refuses to
    pin then): ``Tensor.pin_memory()`` returns the tensor, and ``torch.tensor(..., pin_memory=True)`` builds an
    unpinned one. SGLang pins the extra-buffer track mask in ``ScheduleBatch.prepare_for_decode`` without asking
    whether the server has a GPU (0.5.23 through ``pin_memory()``, 0.5.12 and 0.5.13 through the keyword)."""
    import torch

    if torch.accelerator.is_available():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(swapped(torch.Tensor, "pin_memory", _unpinned))
    stack.enter_context(swapped(torch, "tensor", _tensor_unpinned(torch.tensor)))
    return stack



def cpu_server(environment: dict[str, str] | None = None):
    """Within the block, a server's step runs on a machine without a GPU as far as its pools are on the CPU: pinned
    memory is plain memory (:func:`cpu_pin_memory`) and ``torch.cuda.synchronize()`` a no-op
    (:func:`cpu_synchronize`; SGLang's DSA index cache synchronises the device before the CPU copy a decode server's
    retraction backs up); and the process has the server's ``environment`` (``pools.environment``)."""
    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(cpu_pin_memory())
    stack.enter_context(cpu_synchronize(torch.device("cpu")))
    stack.enter_context(environment_set(environment or {}))
    return stack


def _tensor_unpinned(real):
    """``torch.tensor`` that builds in ordinary memory what it was asked to pin (no accelerator to pin it for)."""

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return real(*args, **kwargs)

    return tensor


@lru_cache(maxsize=1)
def one_rank_group():
    """A real one-rank gloo process group, as a single-rank server's attention TP group is; it also initialises the
    default process group, which a tree's host tier all-reduces its sizes over (0.5.18)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="poolfuzz-gloo-"), "store")
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    return dist.new_group([0], backend="gloo")


@contextlib.contextmanager
def root_warnings_off():
    """Within the block, warnings logged on the root logger itself are dropped (SGLang logs some there, not on its own
    loggers, e.g. ``Scheduler.flush_cache``'s refusal of a busy server, which the scheduler path asks for at random).
    A filter on the root logger: records of other loggers, which propagate to its handlers, do not pass it."""
    import logging

    root = logging.getLogger()
    drop = _BelowError()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


class _BelowError:
    """A logging filter that lets through only errors and worse."""

    def filter(self, record) -> bool:
        import logging

        return record.levelno >= logging.ERROR
