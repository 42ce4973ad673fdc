"""Prefill→decode (PD) transfer: main KV by page, then state components by state type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from poolfuzz.pools.errors import PoolError
from poolfuzz.pools.protocol import window_start
from poolfuzz.pools.request import ReqKv

if TYPE_CHECKING:
    from poolfuzz.pools.interface import PoolFamilyInterface as PoolFamily


@dataclass(frozen=True, kw_only=True)
class TransferRecord:
    """What crossed: the state types in the order both sides appended them, and item counts."""

    kv_pages: int
    state_items: tuple[tuple[str, str, int], ...]  # (state type, source, items)

    @property
    def state_types(self) -> tuple[str, ...]:
        return tuple(t for t, _, _ in self.state_items)


class TransferMismatch(PoolError):
    """Prefill and decode disagree on the items of a state component."""


# State types whose items are pages of a request's full-attention tokens: the block scales of a
# quantised KV pool (rows per slot, ``page_size`` rows an item), DSA's index cache (a page a row) and MiniMax's
# index caches (rows per slot).
PAGED_STATE_TYPES = ("BLOCK_SCALE", "DSA", "MINIMAX_INDEX")


def _pages(tokens: torch.Tensor, ps: int) -> torch.Tensor:
    return tokens[::ps] // ps


def _copy_items(src_bufs, dst_bufs, src_items: torch.Tensor, dst_items: torch.Tensor, item_rows: int) -> None:
    if len(src_bufs) != len(dst_bufs):
        raise TransferMismatch(f"{len(src_bufs)} source buffers but {len(dst_bufs)} destination buffers")
    if src_items.numel() != dst_items.numel():
        raise TransferMismatch(f"{src_items.numel()} source items but {dst_items.numel()} destination items")
    for s, d in zip(src_bufs, dst_bufs):
        sv = s.reshape(s.shape[0] // item_rows, item_rows, *s.shape[1:])
        dv = d.reshape(d.shape[0] // item_rows, item_rows, *d.shape[1:])
        dv[dst_items.to(d.device)] = sv[src_items.to(s.device)].to(d.device)


class PDTransfer:
    """Moves one request's state from a prefill family to a decode family that already holds
    its pre-allocated rows and slots (``DecodePreallocQueue``)."""

    def state_components(self, family: PoolFamily) -> list[tuple[str, str]]:
        """(state type, source) in the order both sides append them, with the MAMBA fallback."""
        out = [(t, "kv_pool") for t in family.kv_pool.state_types]
        if "MAMBA" not in family.kv_pool.state_types and family.req_pool.mamba_pool is not None:
            out.append(("MAMBA", "req_pool"))
        return out

    def state_buffers(self, family: PoolFamily, state_type: str, source: str):
        if source == "req_pool":
            return family.req_pool.get_state_buf_infos()
        return family.kv_pool.get_state_buf_infos(state_type)

    def state_items(self, req: ReqKv, family: PoolFamily, state_type: str, length: int) -> torch.Tensor:
        ps = family.config.page_size
        if state_type == "SWA":
            start = window_start(family.config, length)
            tokens = family.req_pool.read(req.req_pool_idx, start, length)
            return _pages(family.allocator.translate(tokens), ps)
        if state_type == "MAMBA":
            return torch.tensor([req.mamba_pool_idx], dtype=torch.int64)
        if state_type in PAGED_STATE_TYPES:  # items are the pages of the request's tokens, as for main KV
            return _pages(family.req_pool.read(req.req_pool_idx, 0, length), ps)
        raise TransferMismatch(f"unknown state type {state_type!r}")

    def transfer(self, *, src: ReqKv, src_family: PoolFamily, dst: ReqKv, dst_family: PoolFamily) -> TransferRecord:
        length = src.kv_committed_len
        ps = src_family.config.page_size
        src_tokens = src_family.req_pool.read(src.req_pool_idx, 0, length)
        dst_tokens = dst_family.req_pool.read(dst.req_pool_idx, 0, length)
        src_pages, dst_pages = _pages(src_tokens, ps), _pages(dst_tokens, ps)
        _copy_items(src_family.kv_pool.get_contiguous_buf_infos(), dst_family.kv_pool.get_contiguous_buf_infos(),
                    src_pages, dst_pages, ps)
        moved = []
        src_components = self.state_components(src_family)
        dst_components = self.state_components(dst_family)
        if [t for t, _ in src_components] != [t for t, _ in dst_components]:
            raise TransferMismatch(f"state types differ: prefill {src_components}, decode {dst_components}")
        for (state_type, src_source), (_, dst_source) in zip(src_components, dst_components):
            s_items = self.state_items(src, src_family, state_type, length)
            d_items = self.state_items(dst, dst_family, state_type, length)
            rows = ps if state_type in ("SWA", "BLOCK_SCALE", "MINIMAX_INDEX") else 1
            _copy_items(self.state_buffers(src_family, state_type, src_source),
                        self.state_buffers(dst_family, state_type, dst_source), s_items, d_items, rows)
            moved.append((state_type, src_source, s_items.numel()))
        return TransferRecord(kv_pages=src_pages.numel(), state_items=tuple(moved))
