"""Per-request KV bookkeeping and the retraction backup record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from poolfuzz.pools.mamba import MambaCpuCopy


@dataclass(frozen=True, kw_only=True)
class HostTransfer:
    """Host slots that hold one sub-pool's part of a host_pool backup."""

    space: str  # "host.full" or "host.swa"
    host_indices: torch.Tensor
    first_position: int  # logical position of the first backed-up row
    num_tokens: int

    def __repr__(self) -> str:
        return f"HostTransfer({self.space}, positions {self.first_position}..{self.first_position + self.num_tokens})"


@dataclass(frozen=True, kw_only=True)
class RetractionBackup:
    """What a retracted request keeps while it owns no device slots (SGLang's ``RetractionBackup``).

    ``cpu_tensors``: the KV pool's opaque CPU payload (cpu_tensor mode).
    ``host_transfers``: host slots per sub-pool (host_pool mode).
    ``mamba_cpu``: recurrent state the KV pool left behind (``cpu_copy_carries_mamba`` False);
    None when the KV pool carries it or the model has none.
    """

    mode: str
    num_tokens: int  # seqlen - 1 at retraction
    cpu_tensors: Any = None
    host_transfers: tuple[HostTransfer, ...] = ()
    mamba_cpu: MambaCpuCopy | None = None

    def __repr__(self) -> str:
        return (f"RetractionBackup({self.mode}, tokens={self.num_tokens}, "
                f"mamba_cpu={'yes' if self.mamba_cpu is not None else 'no'})")


@dataclass(kw_only=True)
class ReqKv:
    """The KV side of one request (SGLang's ``ReqKvInfo``): which rows and slots it holds now.

    ``seqlen`` counts prompt and output tokens; the last sampled token has no KV yet, so a
    decoding request has ``kv_committed_len == seqlen - 1``.
    """

    rid: int
    seqlen: int = 0
    req_pool_idx: int | None = None
    mamba_pool_idx: int | None = None
    kv_allocated_len: int = 0
    kv_committed_len: int = 0
    swa_evicted_seqlen: int = 0
    mamba_needs_clear: bool = False
    mamba_cow_src: int | None = None
    # Extra-buffer mode: the track slots held beside the state slot, and how many forwards wrote
    # one (the overlap schedule alternates them: the slot the previous step wrote stays readable)
    mamba_track: tuple[int, ...] = ()
    track_writes: int = 0
    retraction_backup: RetractionBackup | None = None
    retraction_count: int = 0
    # Set by a family whose resume recomputes instead of restoring (vLLM): the first position the
    # engine must write again; None when the resume restored everything itself.
    recompute_from: int | None = None
    # Set beside ``recompute_from`` by a family whose recompute continues the recurrent state from a
    # copy-on-write (SGLang's mamba tree): the tokens the copied state already holds. The family's
    # deferred state operations (the copy) run first and the forward folds only the tokens after
    # them. None: the recompute writes the state outright (vLLM's resume rebuilds it from all tokens).
    state_recompute_from: int | None = None
    # Positions ``[0, cache_protected_len)`` are a prefix tree's (a radix hit, or what the tree took
    # at a checkpoint), shared and locked, not the request's own (SGLang's ``cache_protected_len``)
    cache_protected_len: int = 0

    def __repr__(self) -> str:
        return f"Req({self.rid})"
