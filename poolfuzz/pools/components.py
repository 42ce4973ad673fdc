"""Component buffers: the per-layer tensors a pool stores, named so a mismatch can say which one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # fp8 KV is stored as raw bytes, as SGLang's ``store_dtype`` is uint8 for fp8 dtypes.
    "fp8_e4m3": torch.uint8,
}


@dataclass(frozen=True, kw_only=True)
class Component:
    """One addressable buffer: ``tensor[slot]`` is the row a slot of ``space`` owns in ``layer``."""

    name: str  # "full.k", "full.v", "swa.k", "swa.v", "mamba.conv0", "mamba.temporal"
    layer: int  # global layer id
    space: str  # index space of dim 0: "full", "swa" or "mamba"
    tensor: torch.Tensor

    def __repr__(self) -> str:  # never dump the tensor
        return f"Component({self.name} layer {self.layer}, {self.space} x{self.tensor.shape[0]})"


def zeros(shape, *, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """``torch.zeros``, but on the CPU a large buffer costs nothing until its pages are touched.

    numpy's ``zeros`` takes fresh zero pages from the OS (calloc) instead of writing them, so a
    pool of a million slots is built in microseconds and only the slots a run uses are ever
    faulted in. A plain torch tensor over that memory; on other devices ``torch.zeros``.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).reshape(shape)
