"""Memoised traceable rows for the engine's writes: the same bytes ``build_rows`` makes, built once.

Every row the engine writes is a pure function of its tag (component, kind, request, position,
chain), so the rows of one request's positions, of one culprit's poison, or of one request's
recurrent state at one position (for all 251 chain values at once) are built in one batch the
first time and sliced afterwards. Building a row costs a dozen small tensor ops; slicing one
costs one, which is most of what a write used to cost. The cache is shared by every engine in
the process (examples reuse request ids and positions) and bounded.
"""

from __future__ import annotations

import torch

from poolfuzz.harness.checksums import row_checksums
from poolfuzz.harness.contents import CHAIN_MOD, KIND_KV, KIND_POISON, KIND_STATE, REJECTED_DRAFT_CHAIN
from poolfuzz.harness.ledger import POISON_CHAIN, ComponentSpec, Ledger, build_rows

MAX_ENTRIES = 50_000
_CPU = torch.device("cpu")
_cache: dict[tuple, torch.Tensor] = {}


def _span(n: int) -> int:
    return max(64, 1 << (max(n, 1) - 1).bit_length())


def _get(key: tuple, need: int, make) -> torch.Tensor:
    rows = _cache.get(key)
    if rows is None or rows.shape[0] < need:
        if len(_cache) >= MAX_ENTRIES:
            _cache.clear()
        rows = make(_span(need))
        _cache[key] = rows
    return rows


def kv_rows(spec: ComponentSpec, rid: int, start: int, end: int, device) -> torch.Tensor:
    """``build_rows(spec, kind=KIND_KV, rid=rid, position=arange(start, end), chain=0)``."""
    dev = torch.device(device)
    rows = _get(("kv", spec, rid, dev), end, lambda n: build_rows(
        spec, kind=KIND_KV, rid=rid, position=torch.arange(n), chain=0, device=dev))
    return rows[start:end]


def rejected_draft_rows(spec: ComponentSpec, rid: int, start: int, end: int, device) -> torch.Tensor:
    """``kv_rows`` with the rejected-draft chain byte: what a tree verify wrote on its other branch."""
    dev = torch.device(device)
    rows = _get(("draft", spec, rid, dev), end, lambda n: build_rows(
        spec, kind=KIND_KV, rid=rid, position=torch.arange(n), chain=REJECTED_DRAFT_CHAIN, device=dev))
    return rows[start:end]


def tagged_rows(spec: ComponentSpec, *, kind: int, rid: int, position: int, chain: int, n: int,
                device) -> torch.Tensor:
    """``n`` copies of the row ``build_rows(spec, kind=kind, rid=rid, position=position, chain=chain)``
    (poison, padding: one tag written to many slots)."""
    dev = torch.device(device)
    rows = _get(("tag", spec, kind, rid, chain, dev), position + 1, lambda m: build_rows(
        spec, kind=kind, rid=rid, position=torch.arange(m), chain=chain, device=dev))
    return rows[position:position + 1].expand(n, *spec.row_shape)


def poison_rows(spec: ComponentSpec, *, culprit: int, step: int, n: int, device) -> torch.Tensor:
    """``ledger.poison_rows``: ``n`` copies of the poison row of (culprit, step)."""
    return tagged_rows(spec, kind=KIND_POISON, rid=culprit, position=step, chain=POISON_CHAIN, n=n, device=device)


def _state_table(spec: ComponentSpec, rid: int, position: int) -> torch.Tensor:
    """The state rows of (request, position) for every chain value, on the host."""
    return _get(("state", spec, rid, position, _CPU), CHAIN_MOD, lambda _: build_rows(
        spec, kind=KIND_STATE, rid=rid, position=position, chain=torch.arange(CHAIN_MOD), device=_CPU))


def state_row(spec: ComponentSpec, rid: int, position: int, chain: int) -> torch.Tensor:
    """The host-side ``state_rows`` for one chain value known as an int: a view of the table."""
    return _state_table(spec, rid, position)[chain]


def state_checksum(spec: ComponentSpec, rid: int, position: int, chain: int) -> int:
    """``row_checksums`` of ``state_row(...)``: the ledger's expected state, from the same table
    the engine's write used (one build for both), all chain values checksummed at once."""
    sums = _get(("state-sum", spec, rid, position), CHAIN_MOD,
                lambda _: row_checksums(_state_table(spec, rid, position)))
    return int(sums[chain])


def state_rows(spec: ComponentSpec, rid: int, position: int, chain: torch.Tensor, device) -> torch.Tensor:
    """``build_rows(spec, kind=KIND_STATE, rid=rid, position=position, chain=chain)`` for a chain
    tensor on the device (values in ``0..CHAIN_MOD-1``): a gather, so no host sync."""
    dev = torch.device(device)
    table = _get(("state", spec, rid, position, dev), CHAIN_MOD, lambda _: build_rows(
        spec, kind=KIND_STATE, rid=rid, position=position, chain=torch.arange(CHAIN_MOD), device=dev))
    return table[chain.reshape(-1).to(dev)]


MAX_LEDGER_ENTRIES = 200_000
_ledger: Ledger | None = None


def shared_ledger() -> Ledger:
    """One Ledger for every engine in the process: its expected checksums are pure functions of
    (component, owner, positions) and of state histories, so examples share them instead of each
    recomputing them. Replaced by a fresh one when it has grown large."""
    global _ledger
    if _ledger is None or len(_ledger._kv) + len(_ledger._state) + len(_ledger._chain) > MAX_LEDGER_ENTRIES:
        _ledger = Ledger()
    return _ledger


def release() -> None:
    """Drop every memoised row and expected checksum: a fuzzing process calls this when it is done
    with a config, whose components (and so cache keys) the next config does not share, so that a
    long run over every config holds one config's caches at a time, not all of them."""
    global _ledger
    _cache.clear()
    _ledger = None
