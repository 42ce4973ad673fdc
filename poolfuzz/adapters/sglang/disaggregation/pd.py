"""Prefill→decode transfer over SGLang's own PD registration, moved by descriptor as a transfer engine does.

Each node registers its buffers the way SGLang's disaggregation setup does: the main KV from
``get_kv_transfer_buf_infos`` (``get_contiguous_buf_infos``: a pointer, a length and an item length per
buffer) and the state components from ``setup_state_kv_args`` (SWA pages, mamba slots through
``HybridReqToTokenPool.get_state_buf_infos``, DSA index pages, block scales, in the order both sides
append them). What a request sends is what SGLang's prefill computes for it: the pages of its tokens,
and per state type its items (the mamba slot the row maps to, the SWA pages of the window). The copy is
a transfer engine's: for every registered buffer, ``item_len`` bytes from ``src_ptr + src_item * item_len``
to ``dst_ptr + dst_item * item_len`` (``ctypes.memmove``: the buffers are host memory here). A descriptor
that misstates a buffer, an item length or a state component moves the wrong bytes, and the checksums
of the transferred request say whose.
"""

from __future__ import annotations

import ctypes
import types

import torch

from poolfuzz.adapters.sglang.api import first_importable
from poolfuzz.adapters.sglang.host_tier.kernel_io import REGISTRY, IllegalAddress, register_buffers
from poolfuzz.pools.errors import PoolError
from poolfuzz.pools.request import ReqKv
from poolfuzz.pools.transfer import TransferMismatch, TransferRecord

_UTILS = "sglang.srt.disaggregation.utils"


def pd_problem(api) -> str | None:
    """Why this release's PD registration cannot be driven here, or None."""
    if first_importable(f"{_UTILS}:setup_state_kv_args", required=False) is None:
        return f"SGLang {api.version} has no setup_state_kv_args to register PD buffers with"
    return None


def registration(family):
    """The node's PD registration (SGLang's ``KVArgs`` fields the transfer reads), made once."""
    got = getattr(family, "_pd_args", None)
    if got is None:
        kv_args = types.SimpleNamespace()
        # get_kv_transfer_buf_infos where the release has it (it picks a sparse pool's own), else the
        # pool's get_contiguous_buf_infos, which it returns for every other pool
        infos = first_importable(f"{_UTILS}:get_kv_transfer_buf_infos", required=False)
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = (
            infos(family.sg_kv_pool) if infos is not None else family.sg_kv_pool.get_contiguous_buf_infos())
        setup_state_kv_args = first_importable(f"{_UTILS}:setup_state_kv_args")
        setup_state_kv_args(kv_args, family.sg_kv_pool, req_to_token_pool=family.sg_req_pool)
        # the model layer of every entry (a hybrid pool's ``get_kv_layer_ids``; [] for the others), as prefill
        # and decode register it where the release pairs entries by layer
        layer_ids = first_importable(f"{_UTILS}:build_kv_layer_ids", required=False)
        kv_args.kv_layer_ids = [] if layer_ids is None else layer_ids(
            token_to_kv_pool=family.sg_kv_pool, draft_token_to_kv_pool=None, num_draft_entries=0,
            num_hidden_layers=family.config.num_layers)
        got = family._pd_args = kv_args
        # what the transfer may address: the node's live pool buffers (see _check_span)
        register_buffers(family.sg_kv_pool, family.sg_req_pool)
    return got


def _check_span(address: int, nbytes: int, what: str) -> None:
    """The bytes a descriptor names lie in one live pool buffer of the node. A transfer engine writes
    wherever the registration points (on a GPU, into freed memory a later tensor reuses, silently); here
    the copy is ``memmove`` into this process's heap, so a stale pointer is raised instead, with where."""
    try:
        data, offset = REGISTRY.resolve(address, nbytes, what)
    except IllegalAddress:
        raise IllegalAddress(f"PD transfer of {what}: the registered bytes at {address:#x} ({nbytes}) lie in no "
                             "live pool buffer of the node (a registration of a freed or temporary tensor: an "
                             "illegal or stale-memory access on the GPU)") from None
    if offset + nbytes > data.numel():
        raise IllegalAddress(f"PD transfer of {what}: {nbytes} bytes at {address:#x} run {offset + nbytes - data.numel()} "
                             "bytes past the end of the pool buffer they start in (an item length or item index the "
                             "registration misstates)")


def _pages(tokens: torch.Tensor, ps: int) -> list[int]:
    """``kv_to_page_indices``: the page of every page-start token."""
    return [int(t) // ps for t in tokens[::ps].tolist()]


def state_items(family, req: ReqKv, state_type, length: int) -> list[int]:
    """The items a request sends (or receives) for one state type, as SGLang's prefill computes them."""
    name = getattr(state_type, "name", str(state_type))
    c = family.config
    ps = c.page_size
    pool = family.sg_req_pool
    if name == "MAMBA":
        slot = pool.req_index_to_mamba_index_mapping[req.req_pool_idx]
        translate = getattr(pool, "translate_mamba_indices", None)  # the _mamba_payload of either side
        return [int(translate(slot.reshape(1))[0]) if translate is not None else int(slot)]
    if name in ("SWA", "BLOCK_SCALE_SWA"):
        start = max(0, length - c.sliding_window) // ps * ps
        full = pool.req_to_token[req.req_pool_idx, start:length].to(torch.int64)
        alloc = family.sg_allocator
        swa = getattr(alloc, "translate_swa_indices_for_transfer", alloc.translate_loc_from_full_to_swa)(full)
        return _pages(swa.to("cpu", torch.int64), ps)
    # NSA: the DSA state's name up to 0.5.12 (same pages, prefill.py's _nsa_payload)
    if name in ("DSA", "NSA", "BLOCK_SCALE", "MINIMAX_INDEX_K", "MINIMAX_DENSE_KV"):
        return _pages(kv_indices(family, req, length), ps)
    if name == "REQUEST_ROW":
        return [req.req_pool_idx]
    raise TransferMismatch(f"state type {name} is registered but the adapter does not compute its items")


def kv_indices(family, req: ReqKv, length: int) -> torch.Tensor:
    """The request's token ids as the transfer engine addresses them: the row, through the allocator's
    ``translate_kv_indices_for_transfer`` where the release has it (identity for a static pool)."""
    raw = family.sg_req_pool.req_to_token[req.req_pool_idx, :length].to(torch.int64)
    translate = getattr(family.sg_allocator, "translate_kv_indices_for_transfer", None)
    return (translate(raw) if translate is not None else raw).to("cpu", torch.int64)


def _move(src_ptrs, dst_ptrs, item_lens, dst_item_lens, src_items, dst_items, what: str) -> None:
    """The transfer engine: each item of each registered buffer, by its descriptor."""
    if len(src_ptrs) != len(dst_ptrs) or list(item_lens) != list(dst_item_lens):
        raise TransferMismatch(f"{what}: prefill registers {len(src_ptrs)} buffers of items {list(item_lens)}, "
                               f"decode {len(dst_ptrs)} of {list(dst_item_lens)}")
    if len(src_items) != len(dst_items):
        raise TransferMismatch(f"{what}: {len(src_items)} items sent, {len(dst_items)} expected")
    for src, dst, item in zip(src_ptrs, dst_ptrs, item_lens):
        if src_items and item:
            _check_span(src + min(src_items) * item, (max(src_items) - min(src_items) + 1) * item, f"{what} (prefill)")
            _check_span(dst + min(dst_items) * item, (max(dst_items) - min(dst_items) + 1) * item, f"{what} (decode)")
        for s, d in zip(src_items, dst_items):
            ctypes.memmove(dst + d * item, src + s * item, item)


def _entry_pairs(s_args, d_args) -> list[tuple[int, int]]:
    """(prefill entry, decode entry) of the main KV: paired by model layer with the release's
    ``build_transfer_entry_pairs`` where it has one (the transfer engines do), else by position."""
    n_src, n_dst = len(s_args.kv_data_ptrs), len(d_args.kv_data_ptrs)
    build = first_importable(f"{_UTILS}:build_transfer_entry_pairs", required=False)
    if build is None:
        if n_src != n_dst:
            raise TransferMismatch(f"main KV: prefill registers {n_src} buffers, decode {n_dst}")
        return [(i, i) for i in range(n_src)]
    try:
        return build(s_args.kv_layer_ids, d_args.kv_layer_ids, n_src, n_dst)
    except RuntimeError as exc:  # the engines refuse a registration they cannot pair
        raise TransferMismatch(f"main KV: {exc}") from None


class SGLangPDTransfer:
    """Moves one request between two SGLang families by their PD registrations (see the module docstring)."""

    def transfer(self, *, src: ReqKv, src_family, dst: ReqKv, dst_family) -> TransferRecord:
        if src_family.device.type != "cpu":
            raise PoolError("the sglang family's PD transfer copies host memory; on a GPU a transfer engine "
                            "(Mooncake, NIXL) moves the bytes")
        tokens = src_family.protocol.token_ids(src.rid)
        if tokens is not None:  # the request's token ids travel with it (the decode server receives its prompt)
            dst_family.protocol.adopt_token_ids(dst.rid, tokens)
        s_args, d_args = registration(src_family), registration(dst_family)
        length = src.kv_committed_len
        ps = src_family.config.page_size
        s_pages = _pages(kv_indices(src_family, src, length), ps)
        d_pages = _pages(kv_indices(dst_family, dst, length), ps)
        pairs = _entry_pairs(s_args, d_args)
        _move([s_args.kv_data_ptrs[i] for i, _ in pairs], [d_args.kv_data_ptrs[j] for _, j in pairs],
              [s_args.kv_item_lens[i] for i, _ in pairs], [d_args.kv_item_lens[j] for _, j in pairs], s_pages, d_pages,
              "main KV")
        if [str(t) for t in s_args.state_types] != [str(t) for t in d_args.state_types]:
            raise TransferMismatch(f"state types differ: prefill {s_args.state_types}, decode {d_args.state_types}")
        moved = []
        for i, state_type in enumerate(s_args.state_types):
            s_items = state_items(src_family, src, state_type, length)
            d_items = state_items(dst_family, dst, state_type, length)
            name = getattr(state_type, "name", str(state_type))
            _move(s_args.state_data_ptrs[i], d_args.state_data_ptrs[i], s_args.state_item_lens[i],
                  d_args.state_item_lens[i], s_items, d_items, name)
            moved.append((name, "registration", len(s_items)))
        return TransferRecord(kv_pages=len(s_pages), state_items=tuple(moved))
