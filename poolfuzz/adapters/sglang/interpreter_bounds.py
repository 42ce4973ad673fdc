"""Triton's interpreter addressing memory as a GPU's kernel does: a lane that reads outside the tensors its launch was
given reads nothing this process owns, and a lane that writes there raises ``IllegalAddress`` naming the kernel.

Triton's interpreter (``TRITON_INTERPRET=1``: every kernel on a machine without a GPU,
``shims._interpret_kernels_without_gpu``) dereferences a kernel's raw addresses on the CPU, so a stray lane reads or
writes this process's memory, or kills it with SIGSEGV, and with it the run and every finding it held. SGLang 0.5.10's
paged ``alloc_extend`` launches its kernel for more pages than the free list holds and only then checks the count and
answers None, discarding what the kernel read: on a GPU that read lands in the caching allocator's memory and is
harmless; interpreted, it crashed the run. So every address a load or store touches (the lanes its mask leaves on) is
checked against the storages of the launch's tensor arguments (the interpreter's host copies), before the access: a
read outside them is a masked-off lane (its ``other`` value, zeros by default: what a discarded read may hold), a
write outside them raises (on a GPU it corrupts another allocation, or faults). The kernels are SGLang's, unchanged.
"""

from __future__ import annotations

import numpy as np

from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress

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
        inside = _inside(ptrs, mask, interpreter)
        if inside is not None:  # the lanes outside read as masked off
            mask = interpreter.TensorHandle(np.asarray(mask.data, dtype=bool) & inside, mask.dtype)
        return load(self, ptrs, mask, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        inside = _inside(ptrs, mask, interpreter)
        if inside is not None:
            _raise_outside(ptrs, mask, inside, interpreter)
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


def _inside(ptrs, mask, interpreter):
    """Where any lane the mask leaves on addresses bytes outside the running launch's tensors: a boolean array of the
    lanes' shape (True: inside); None where every lane is inside (or no launch is running)."""
    if not _LAUNCHES:
        return None
    spans = _LAUNCHES[-1][1]
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    inside = np.zeros(addresses.shape, dtype=bool)
    for lo, hi in spans:
        inside |= (addresses >= lo) & (addresses + size <= hi)
    return None if bool((inside | ~on).all()) else inside


def _raise_outside(ptrs, mask, inside, interpreter) -> None:
    name = _LAUNCHES[-1][0]
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    outside = addresses[on & ~inside]
    raise IllegalAddress(f"Triton kernel {name} writes {size} bytes at {int(outside[0]):#x}, outside every tensor it "
                         f"was launched with ({outside.size} of {int(on.sum())} lanes): an illegal memory access on a "
                         "GPU")
