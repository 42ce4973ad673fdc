"""Triton's interpreter with a GPU's view of a stray address: a kernel lane that reads memory this process has not
mapped reads as masked off, one that writes there raises ``IllegalAddress`` naming the kernel, instead of SIGSEGV.

Triton's interpreter (``TRITON_INTERPRET=1``: every kernel on a machine without a GPU,
``shims._interpret_kernels_without_gpu``) dereferences a kernel's raw addresses on the CPU. SGLang 0.5.10's paged
``alloc_extend`` launches its kernel for more pages than its free list holds and only then checks the count and
answers None, discarding what the kernel read: on a GPU that read lands in the caching allocator's memory and is
harmless; interpreted, it reached an unmapped page and the SIGSEGV killed the run and every finding it held. So each
lane a load or store leaves on is checked before the access: inside a storage of the launch's tensor arguments (the
interpreter's host copies), or else inside memory this process has mapped with the access's permission (a kernel that
reads through a table of raw pointers, as ``write_req_to_token_pool_triton`` reads prefix rows, reaches tensors it was
not given), and it goes ahead as the interpreter runs it; only an address in no mapping, which would have killed the
process, is stood in for as a GPU's stray access. The kernels are SGLang's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poolfuzz.adapters.sglang.illegal_address import IllegalAddress

# The launches running now, innermost last: (the kernel's name, the [lo, hi) byte spans of its arguments' storages).
_LAUNCHES: list[tuple[str, list[tuple[int, int]]]] = []


def install() -> bool:
    """Bounds-check the loads and stores of every kernel the interpreter runs in this process; False where already."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if "_poolfuzz_bounds" in vars(executor):
        return False
    init_args, call = executor._init_args_hst, executor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _LAUNCHES.append((self.fn.__name__, _spans([*args_hst, *kwargs_hst.values()])))
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        depth = len(_LAUNCHES)
        try:
            return call(self, *args, **kwargs)
        except interpreter.InterpreterError as exc:  # the interpreter wraps what a kernel raised in its repr
            if isinstance(exc.__cause__, IllegalAddress):
                raise exc.__cause__ from None
            raise
        finally:
            del _LAUNCHES[depth:]

    def masked_load(self, ptrs, mask, *args, **kwargs):
        stray = _stray(ptrs, mask, interpreter, permission="r")
        if stray is not None:  # the lanes in no mapping read as masked off
            mask = interpreter.TensorHandle(np.asarray(mask.data, dtype=bool) & ~stray.lanes, mask.dtype)
        return load(self, ptrs, mask, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        stray = _stray(ptrs, mask, interpreter, permission="w")
        if stray is not None:
            raise IllegalAddress(f"Triton kernel {_LAUNCHES[-1][0]} writes {stray.size} bytes at {stray.first:#x}, in "
                                 f"no memory this process has mapped writable ({stray.count} of {stray.on} lanes): an "
                                 "illegal memory access on a GPU")
        return store(self, ptrs, value, mask, *args, **kwargs)

    executor._init_args_hst, executor.__call__ = init_args_hst, launch
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    executor._poolfuzz_bounds = True
    return True


def _spans(args) -> list[tuple[int, int]]:
    """The byte spans of the storages of the tensors among ``args`` (tuples of tensors too)."""
    out = []
    for arg in args:
        if isinstance(arg, tuple):
            out += _spans(arg)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return out


@dataclass(frozen=True, kw_only=True)
class _Stray:
    """The lanes of one load or store that address no argument storage and no mapping with the access's permission."""

    lanes: np.ndarray  # of the pointers' shape, True where stray
    size: int  # bytes a lane accesses
    first: int  # the first stray address
    count: int  # stray lanes
    on: int  # lanes the mask leaves on


def _stray(ptrs, mask, interpreter, *, permission: str) -> _Stray | None:
    """The stray lanes of a load or store in the running launch (``permission``: ``r`` or ``w``), or None."""
    if not _LAUNCHES:
        return None
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    stray = on.copy()
    for lo, hi in _LAUNCHES[-1][1]:
        stray &= ~((addresses >= lo) & (addresses + size <= hi))
    if stray.any():
        stray[stray] = ~_MAPPED.covers(addresses[stray], size, permission)
    if not stray.any():
        return None
    return _Stray(lanes=stray, size=size, first=int(addresses[stray][0]), count=int(stray.sum()), on=int(on.sum()))


class _Mappings:
    """This process's memory mappings (``/proc/self/maps``), read again when an address is in none of them (memory
    mapped since); where the process cannot list them, every address counts as mapped (the interpreter as shipped)."""

    def __init__(self):
        self.starts = self.ends = None
        self.allowed: dict[str, np.ndarray] = {}  # permission ("r", "w") -> whether each mapping grants it

    def covers(self, addresses, size: int, permission: str):
        found = self._lookup(addresses, size, permission)
        if not found.all() and self._read():
            found = self._lookup(addresses, size, permission)
        return found

    def _lookup(self, addresses, size: int, permission: str):
        if self.starts is None and not self._read():
            return np.ones(addresses.shape, dtype=bool)
        at = np.searchsorted(self.starts, addresses, side="right") - 1
        ok = at >= 0
        at = np.where(ok, at, 0)
        return ok & (addresses + np.uint64(size) <= self.ends[at]) & self.allowed[permission][at]

    def _read(self) -> bool:
        try:
            with open("/proc/self/maps") as maps:
                rows = sorted((int(lo, 16), int(hi, 16), perms) for (lo, hi), perms in
                              ((line.split()[0].split("-"), line.split()[1]) for line in maps))
        except OSError:
            return False
        self.starts = np.array([lo for lo, _, _ in rows], dtype=np.uint64)
        self.ends = np.array([hi for _, hi, _ in rows], dtype=np.uint64)
        self.allowed = {p: np.array([p in perms for _, _, perms in rows], dtype=bool) for p in "rw"}
        return True


_MAPPED = _Mappings()
