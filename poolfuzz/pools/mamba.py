"""Mamba (recurrent) state storage and its slot allocator; slot 0 is reserved."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.pools.allocator import SlotAllocator, as_index
from poolfuzz.pools.components import DTYPES, Component


@dataclass(frozen=True, kw_only=True)
class MambaCpuCopy:
    """The recurrent state of some slots on the CPU: conv tensors and temporal, nothing else."""

    conv: tuple[torch.Tensor, ...]  # each [mamba_layers, n, *conv_shape]
    temporal: torch.Tensor  # [mamba_layers, n, heads, head_dim, state]

    def __repr__(self) -> str:
        return f"MambaCpuCopy(slots={self.temporal.shape[1]})"


def named_state(conv, temporal: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A mamba pool's state tensors (each ``[layers, slots+1, ...]``) by component name; a state of conv windows only
    (Inkling's short convolutions: temporal ``(0, 0, 0)``) has no temporal part to name. Every family's mamba view
    names its state through this."""
    named = [(f"mamba.conv{i}", c) for i, c in enumerate(conv)]
    return named + ([("mamba.temporal", temporal)] if temporal[0, 0].numel() else [])


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that never aliases ``t``: on CPU ``.to("cpu")`` returns the tensor itself."""
    return t.to("cpu", copy=True) if t.device.type == "cpu" else t.to("cpu")


class MambaPool:
    """Conv and temporal state, ``[mamba_layers, slots+1, ...]``; storage only, no allocator.

    Created zeroed. Neither allocation nor free zeroes a slot: a fresh slot is cleared only by
    ``clear_slots``, which the engine runs on an extend (prefill) forward, as SGLang does.

    ``spec_scratch``: speculative decoding's intermediate state caches
    (:class:`poolfuzz.pools.speculative.SpeculativeScratch`), or None when the config has none.
    """

    spec_scratch = None

    def __init__(self, *, size: int, num_layers: int, conv_shapes, temporal_shape, dtype: str,
                 device: torch.device, layer_ids: tuple[int, ...]):
        self.size = size
        self.num_layers = num_layers
        self.layer_ids = layer_ids
        self.device = torch.device(device)
        torch_dtype = DTYPES[dtype]
        self.conv = [
            torch.zeros((num_layers, size + 1, *shape), dtype=torch_dtype, device=self.device)
            for shape in conv_shapes
        ]
        self.temporal = torch.zeros(
            (num_layers, size + 1, *temporal_shape), dtype=torch_dtype, device=self.device
        )

    def _idx(self, idx) -> torch.Tensor:
        return as_index(idx).to(self.device)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return named_state(self.conv, self.temporal)

    def local_layer(self, layer_id: int) -> int:
        """Where a model layer's state lives in the stacked tensors: its rank among the mamba layers
        (SGLang's layer-id map), whatever attention layers lie between them."""
        return self.layer_ids.index(layer_id)

    def components(self) -> list[Component]:
        """Each mamba layer's state, as the model's forward reaches it: through its layer id."""
        return [
            Component(name=name, layer=layer_id, space="mamba", tensor=t[self.local_layer(layer_id)])
            for name, t in self.state_tensors()
            for layer_id in self.layer_ids
        ]

    def clear_slots(self, idx) -> None:
        i = self._idx(idx)
        for _, t in self.state_tensors():
            t[:, i] = 0

    def copy_from(self, src, dst) -> None:
        s, d = self._idx(src), self._idx(dst)
        for _, t in self.state_tensors():
            t[:, d] = t[:, s]

    def get_cpu_copy(self, idx) -> MambaCpuCopy:
        i = self._idx(idx)
        return MambaCpuCopy(conv=tuple(cpu_copy(c[:, i]) for c in self.conv),
                            temporal=cpu_copy(self.temporal[:, i]))

    def load_cpu_copy(self, cpu: MambaCpuCopy, idx) -> None:
        i = self._idx(idx)
        for c, saved in zip(self.conv, cpu.conv):
            c[:, i] = saved.to(self.device)
        self.temporal[:, i] = cpu.temporal.to(self.device)

    def get_state_buf_infos(self) -> list[torch.Tensor]:
        """The buffers PD registers for MAMBA state, one per (state tensor, layer); item = one slot."""
        return [t[layer] for _, t in self.state_tensors() for layer in range(self.num_layers)]


class MambaSlotAllocator(SlotAllocator):
    """Free list of mamba slots ``1..size``; no zeroing on alloc or free."""

    def __init__(self, *, size: int):
        super().__init__(size=size, space="mamba")
