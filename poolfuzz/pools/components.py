"""Component buffers: the per-layer tensors a pool stores, named so a mismatch can say which one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mmap

import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # fp8 KV is stored as raw bytes, as SGLang's ``store_dtype`` is uint8 for fp8 dtypes.
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
}


@dataclass(frozen=True, kw_only=True)
class Component:
    """One addressable buffer: ``tensor[slot]`` is the row a slot of ``space`` owns in ``layer``."""

    name: str  # "full.k", "full.v", "swa.k", "swa.v", "mamba.conv0", "mamba.temporal"
    layer: int  # global layer id
    space: str  # index space of dim 0: "full", "swa" or "mamba"
    tensor: torch.Tensor
    # 0: ``tensor[slot]`` is the slot's row. N > 0: a page-major layout (DSA's index cache, whose
    # pages hold all their keys, then all their scales): ``tensor`` is ``[pages, N, *row]`` and the
    # slot's row is ``tensor[slot // N, slot % N]``. Read and write rows through ``at``.
    page_size: int = 0
    # None: ``slots`` index ``tensor`` as they are. Otherwise the engine's own map from the slot ids it hands out to the
    # rows that hold them (a unified memory pool's virtual -> physical ids, which compaction rebinds): read through
    # ``at``, a component is addressed as the engine's kernels address it, wherever its rows have moved.
    translate: Callable[[torch.Tensor], torch.Tensor] | None = None

    def at(self, slots):
        """The index of ``slots``' rows in ``tensor`` (an index tensor, or a (page, offset) pair)."""
        if self.translate is not None:
            slots = self.translate(torch.as_tensor(slots, dtype=torch.int64))
        if not self.page_size:
            return slots
        return slots // self.page_size, slots % self.page_size

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[2:] if self.page_size else self.tensor.shape[1:])

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0] * (self.page_size or 1)

    def __repr__(self) -> str:  # never dump the tensor
        return f"Component({self.name} layer {self.layer}, {self.space} x{self.num_slots})"


def zeros(shape, *, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """``torch.zeros``, but on the CPU a large buffer costs nothing until its pages are touched.

    A large host buffer is an anonymous private mapping, which the OS hands out as untouched
    zero pages: a pool of a million slots is built in microseconds and only the slots a run
    uses are ever faulted in (malloc'd memory would have to be cleared, and glibc's adaptive
    mmap threshold makes even calloc clear reused heap memory). It is a plain torch tensor over
    that memory, freed with the tensor. Small buffers and other devices: ``torch.zeros``.
    """
    device = torch.device(device)
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < _LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).reshape(shape)


_LAZY_BYTES = 1 << 20
