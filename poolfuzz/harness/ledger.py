"""The shadow ledger: expected checksums of every logical KV position and recurrent state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.harness.checksums import row_checksums
from poolfuzz.harness.contents import (
    KIND_KV,
    KIND_POISON,
    KIND_STATE,
    component_code,
    encode_rows,
    fold_chain,
)
from poolfuzz.pools.components import Component

POISON_CHAIN = 0xA5


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """What the ledger needs of a component: its key, dtype and row shape (no tensor)."""

    name: str
    layer: int
    space: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.name.removeprefix("host."), self.layer)

    @property
    def code(self) -> int:
        return component_code(self.name)

    @property
    def row_elems(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n

    @classmethod
    def of(cls, comp: Component) -> "ComponentSpec":
        return cls(name=comp.name, layer=comp.layer, space=comp.space, dtype=comp.tensor.dtype,
                   row_shape=comp.row_shape)


def build_rows(spec: ComponentSpec, *, kind, rid, position, chain, device) -> torch.Tensor:
    """Rows in the component's dtype and shape for tags; each argument an int or int64 tensor."""
    n = max(t.numel() if isinstance(t, torch.Tensor) else 1 for t in (kind, rid, position, chain))

    def col(v):
        if isinstance(v, torch.Tensor):
            return v.to(device=device, dtype=torch.int64).reshape(-1).expand(n)
        return torch.full((n,), int(v), dtype=torch.int64, device=device)

    fields = torch.stack([col(kind), col(rid), col(position), col(spec.layer), col(spec.code), col(chain)], 1)
    return encode_rows(fields, spec.row_elems).to(spec.dtype).reshape(n, *spec.row_shape)


class Ledger:
    """Expected per-slot checksums, computed on the host from the reference's logical contents."""

    def __init__(self):
        # Keyed by everything a row's bytes depend on: the ledger is shared by every engine in the
        # process, and two configs may give a component of the same name and layer other shapes.
        self._kv: dict[tuple, torch.Tensor] = {}  # (key, dtype, row shape, owner) -> checksums by position
        self._chain: dict[tuple, int] = {(): 0}
        self._state: dict[tuple, int] = {}

    def kv(self, spec: ComponentSpec, owner: int, start: int, end: int) -> torch.Tensor:
        """Expected checksums of positions ``[start, end)`` holding ``owner``'s tokens."""
        cache_key = (spec.key, spec.dtype, spec.row_shape, owner)
        have = self._kv.get(cache_key)
        if have is None or have.numel() < end:
            size = max(64, 1 << (max(end, 1) - 1).bit_length())
            rows = build_rows(spec, kind=KIND_KV, rid=owner, position=torch.arange(size), chain=0, device="cpu")
            have = row_checksums(rows)
            self._kv[cache_key] = have
        return have[start:end]

    def kv_for_owners(self, spec: ComponentSpec, owners: list[int], start: int, end: int) -> torch.Tensor:
        """Expected checksums for positions whose owners may differ (a forked prefix)."""
        if end <= start:
            return torch.empty(0, dtype=torch.int64)
        parts, run_start = [], start
        for pos in range(start + 1, end + 1):
            if pos == end or owners[pos] != owners[run_start]:
                parts.append(self.kv(spec, owners[run_start], run_start, pos))
                run_start = pos
        return torch.cat(parts)

    def chain(self, history: tuple) -> int:
        got = self._chain.get(history)
        if got is None:
            rid, start, end = history[-1]
            got = fold_chain(self.chain(history[:-1]), rid, start, end)
            self._chain[history] = got
        return got

    def state(self, spec: ComponentSpec, history: tuple) -> int:
        """Expected checksum of a recurrent-state row after consuming ``history``."""
        key = (spec.key, spec.dtype, spec.row_shape, history)
        got = self._state.get(key)
        if got is None:
            if not history:
                rows = torch.zeros((1, *spec.row_shape), dtype=spec.dtype)
            else:
                rid = history[-1][0]
                gen = history[-1][2]
                rows = build_rows(spec, kind=KIND_STATE, rid=rid, position=gen, chain=self.chain(history),
                                  device="cpu")
            got = int(row_checksums(rows)[0])
            self._state[key] = got
        return got

    def describe_state(self, history: tuple) -> str:
        if history is None:
            return "no state"
        if not history:
            return "zeros (cleared)"
        return f"req {history[-1][0]} gen {history[-1][2]} chain {self.chain(history)}"


def poison_rows(spec: ComponentSpec, *, culprit: int, step: int, n: int, device) -> torch.Tensor:
    return build_rows(spec, kind=KIND_POISON, rid=culprit, position=torch.full((n,), step), chain=POISON_CHAIN,
                      device=device)
