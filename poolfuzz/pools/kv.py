"""KV pools: MHA, sliding-window (SWA) and hybrid-linear, with SGLang's per-class CPU-copy semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import DTYPES, Component, zeros
from poolfuzz.pools.mamba import MambaCpuCopy, MambaPool, cpu_copy

CPU_COPY_CHUNK = 8192  # SGLang's cpu_offloading_chunk_size


class KVCache:
    """Base of every KV pool. Capabilities are class attributes that dispatch reads.

    ``cpu_copy_carries_mamba``: whether ``get_cpu_copy``/``load_cpu_copy`` move the request's
    recurrent state when given ``mamba_indices``. False here; a pool that leaves the state behind
    relies on the retraction caller to back it up (``RetractionBackup.mamba_cpu``). If a pool
    declares False but carries the state, it is copied twice; if it declares True but drops
    it, a resumed request decodes on someone else's state (SGLang #35957).

    ``supports_host_pool_backup``: whether the host-pool retraction path can hold this pool's
    components (it has host entries for full KV and SWA, never for recurrent state).

    ``state_types``: the PD state components this pool itself contributes (``"SWA"``,
    ``"MAMBA"``); a model whose recurrent state lives only in the request pool relies on
    the PD fallback for ``"MAMBA"``.
    """

    cpu_copy_carries_mamba: bool = False
    supports_host_pool_backup: bool = False
    state_types: tuple[str, ...] = ()

    def components(self) -> list[Component]:
        raise NotImplementedError

    def get_cpu_copy(self, indices, mamba_indices=None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no CPU copy")

    def load_cpu_copy(self, cpu, indices, mamba_indices=None) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no CPU copy")

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        """Main KV buffers PD moves by page: per layer K then V."""
        raise NotImplementedError

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no {state_type} state")


@dataclass(frozen=True, kw_only=True)
class MHACpuCopy:
    """Per layer, per chunk of 8192 positions, ``(k, v)`` on the CPU."""

    layers: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]
    num_tokens: int

    def __repr__(self) -> str:
        return f"MHACpuCopy(layers={len(self.layers)}, tokens={self.num_tokens})"


class MHATokenToKVPool(KVCache):
    """Per layer ``k_buffer[l]``/``v_buffer[l]`` of ``[size+page_size, heads, head_dim]``."""

    supports_host_pool_backup = True

    def __init__(self, *, size: int, page_size: int, dtype: str, head_num: int, head_dim: int,
                 layer_ids: tuple[int, ...], device: torch.device, name: str = "full"):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = DTYPES[dtype]
        self.layer_ids = layer_ids
        self.device = torch.device(device)
        self.name = name
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [zeros(shape, dtype=self.store_dtype, device=self.device) for _ in layer_ids]
        self.v_buffer = [zeros(shape, dtype=self.store_dtype, device=self.device) for _ in layer_ids]

    def components(self) -> list[Component]:
        out = []
        for local, layer_id in enumerate(self.layer_ids):
            out.append(Component(name=f"{self.name}.k", layer=layer_id, space=self.name, tensor=self.k_buffer[local]))
            out.append(Component(name=f"{self.name}.v", layer=layer_id, space=self.name, tensor=self.v_buffer[local]))
        return out

    def get_cpu_copy(self, indices, mamba_indices=None) -> MHACpuCopy:
        idx = as_index(indices).to(self.device)
        layers = []
        for k, v in zip(self.k_buffer, self.v_buffer):
            chunks = []
            for start in range(0, idx.numel(), CPU_COPY_CHUNK):
                part = idx[start:start + CPU_COPY_CHUNK]
                chunks.append((cpu_copy(k[part]), cpu_copy(v[part])))
            layers.append(tuple(chunks))
        return MHACpuCopy(layers=tuple(layers), num_tokens=idx.numel())

    def load_cpu_copy(self, cpu: MHACpuCopy, indices, mamba_indices=None) -> None:
        idx = as_index(indices).to(self.device)
        assert idx.numel() == cpu.num_tokens, (
            f"load of {cpu.num_tokens} backed-up tokens into {idx.numel()} slots"
        )
        for k, v, chunks in zip(self.k_buffer, self.v_buffer, cpu.layers):
            for i, (k_cpu, v_cpu) in enumerate(chunks):
                part = idx[i * CPU_COPY_CHUNK:(i + 1) * CPU_COPY_CHUNK]
                k[part] = k_cpu.to(self.device)
                v[part] = v_cpu.to(self.device)

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        return [b for pair in zip(self.k_buffer, self.v_buffer) for b in pair]

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """After a tree verify, the accepted tokens' rows move to the front of the window, every layer."""
        tgt, src = as_index(tgt_loc).to(self.device), as_index(src_loc).to(self.device)
        for buffers in self.move_buffers():
            for buf in buffers:
                buf[tgt] = buf[src]

    def move_buffers(self) -> tuple[list[torch.Tensor], ...]:
        """The per-slot buffers a move carries (a subclass with per-slot buffers of its own adds them)."""
        return self.k_buffer, self.v_buffer


@dataclass(frozen=True, kw_only=True)
class SWACpuCopy:
    """SGLang's ``{"full", "swa", "swa_mask"}``: SWA rows only where the position was mapped."""

    full: MHACpuCopy
    swa: MHACpuCopy | None
    swa_mask: torch.Tensor  # bool per backed-up position

    def __repr__(self) -> str:
        return f"SWACpuCopy(tokens={self.full.num_tokens}, swa_rows={int(self.swa_mask.sum())})"


class SWAKVPool(KVCache):
    """Full-attention and sliding-window sub-pools; SWA rows are addressed through ``full_to_swa``.

    Its CPU copy carries full KV and the mapped SWA rows. It accepts ``mamba_indices`` and
    ignores them (SGLang since #24026): a model with SWA *and* recurrent state must have its
    state backed up by the caller, which reads ``cpu_copy_carries_mamba`` to know.
    """

    supports_host_pool_backup = True
    state_types = ("SWA",)

    def __init__(self, *, size: int, size_swa: int, page_size: int, dtype: str, head_num: int,
                 head_dim: int, full_layer_ids, swa_layer_ids, device: torch.device,
                 kv_class: type | None = None):
        # kv_class: the sub-pool class (SGLang's token_to_kv_pool_class), so a fault in it reaches here too
        kv_class = kv_class or MHATokenToKVPool
        self.page_size = page_size
        self.device = torch.device(device)
        self.full_kv_pool = kv_class(size=size, page_size=page_size, dtype=dtype, head_num=head_num,
                                             head_dim=head_dim, layer_ids=tuple(full_layer_ids), device=device)
        self.swa_kv_pool = kv_class(size=size_swa, page_size=page_size, dtype=dtype, head_num=head_num,
                                            head_dim=head_dim, layer_ids=tuple(swa_layer_ids), device=device,
                                            name="swa")
        self.full_to_swa: torch.Tensor | None = None  # registered by the SWA allocator

    def register_mapping(self, full_to_swa: torch.Tensor) -> None:
        self.full_to_swa = full_to_swa

    def translate(self, indices) -> torch.Tensor:
        return self.full_to_swa[as_index(indices)]

    def components(self) -> list[Component]:
        return self.full_kv_pool.components() + self.swa_kv_pool.components()

    def get_cpu_copy(self, indices, mamba_indices=None) -> SWACpuCopy:
        idx = as_index(indices)
        swa_idx = self.translate(idx)
        mask = swa_idx > 0
        swa = self.swa_kv_pool.get_cpu_copy(swa_idx[mask]) if bool(mask.any()) else None
        return SWACpuCopy(full=self.full_kv_pool.get_cpu_copy(idx), swa=swa, swa_mask=mask)

    def load_cpu_copy(self, cpu: SWACpuCopy, indices, mamba_indices=None) -> None:
        idx = as_index(indices)
        self.full_kv_pool.load_cpu_copy(cpu.full, idx)
        if cpu.swa is None:
            return
        new_swa = self.translate(idx)
        new_mask = new_swa > 0
        # Restore rows that were backed up *and* are mapped now. A position mapped now but not
        # backed up keeps whatever its reused SWA slot holds: callers keep new_mask ⊆ old_mask.
        keep = new_mask[cpu.swa_mask]
        if not bool(keep.any()):
            return
        self.swa_kv_pool.load_cpu_copy(select_rows(cpu.swa, keep), new_swa[cpu.swa_mask & new_mask])

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        return self.full_kv_pool.get_contiguous_buf_infos()

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """The full rows move by slot, the SWA rows by the SWA slots the full ones map to."""
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)
        self.swa_kv_pool.move_kv_cache(self.translate(tgt_loc), self.translate(src_loc))

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != "SWA":
            return super().get_state_buf_infos(state_type)
        return self.swa_kv_pool.get_contiguous_buf_infos()


def select_rows(copy: MHACpuCopy, keep: torch.Tensor) -> MHACpuCopy:
    """Filter backed-up rows by a boolean mask over positions, re-chunked (SGLang's _filter_swa_cpu_copy)."""
    layers = []
    for chunks in copy.layers:
        k = torch.cat([c[0] for c in chunks])[keep]
        v = torch.cat([c[1] for c in chunks])[keep]
        layers.append(tuple((k[s:s + CPU_COPY_CHUNK], v[s:s + CPU_COPY_CHUNK])
                            for s in range(0, k.shape[0], CPU_COPY_CHUNK)))
    return MHACpuCopy(layers=tuple(layers), num_tokens=int(keep.sum()))


@dataclass(frozen=True, kw_only=True)
class HybridLinearCpuCopy:
    """``(full copy, mamba copy or None)``."""

    full: MHACpuCopy
    mamba: MambaCpuCopy | None

    def __repr__(self) -> str:
        return f"HybridLinearCpuCopy(tokens={self.full.num_tokens}, mamba={self.mamba is not None})"


class HybridLinearKVPool(KVCache):
    """Full-attention KV plus a reference to the request pool's MambaPool; carries the state itself."""

    cpu_copy_carries_mamba = True
    state_types = ("MAMBA",)

    def __init__(self, *, size: int, page_size: int, dtype: str, head_num: int, head_dim: int,
                 full_layer_ids, device: torch.device, mamba_pool: MambaPool, kv_class: type | None = None,
                 **full_args):
        """``full_args``: what the sub-pool class takes besides the MHA shape (an MLA pool's row parts)."""
        self.page_size = page_size
        self.device = torch.device(device)
        self.head_num, self.head_dim = head_num, head_dim
        self.full_kv_pool = (kv_class or MHATokenToKVPool)(size=size, page_size=page_size, dtype=dtype, head_num=head_num,
                                             head_dim=head_dim, layer_ids=tuple(full_layer_ids), device=device,
                                             **full_args)
        self.mamba_pool = mamba_pool
        # A DSA sub-pool's index cache crosses PD as its own state, after the recurrent state (SGLang: MAMBA, DSA)
        self.state_types = ("MAMBA",) + tuple(self.full_kv_pool.state_types)

    def components(self) -> list[Component]:
        return self.full_kv_pool.components()  # the mamba components belong to the request pool

    def get_cpu_copy(self, indices, mamba_indices=None) -> HybridLinearCpuCopy:
        mamba = None if mamba_indices is None else self.mamba_pool.get_cpu_copy(mamba_indices)
        return HybridLinearCpuCopy(full=self.full_kv_pool.get_cpu_copy(indices), mamba=mamba)

    def load_cpu_copy(self, cpu: HybridLinearCpuCopy, indices, mamba_indices=None) -> None:
        self.full_kv_pool.load_cpu_copy(cpu.full, indices)
        if cpu.mamba is not None and mamba_indices is not None:
            self.mamba_pool.load_cpu_copy(cpu.mamba, mamba_indices)

    def get_contiguous_buf_infos(self) -> list[torch.Tensor]:
        return self.full_kv_pool.get_contiguous_buf_infos()

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)  # recurrent state is per request, not per slot

    def get_state_buf_infos(self, state_type: str) -> list[torch.Tensor]:
        if state_type != "MAMBA":
            return self.full_kv_pool.get_state_buf_infos(state_type)
        return self.mamba_pool.get_state_buf_infos()
