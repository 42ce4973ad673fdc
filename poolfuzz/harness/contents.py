"""Traceable contents: every row written is derived from (request, position, layer, component).

A row holds small integers (0..255, exact in bf16, fp16, fp32 and the uint8 fp8 store):
  [0] kind   (0 zeros: never written or cleared; 1 KV; 2 recurrent state; 3 poison;
             4 padding: the dummy write a padded (CUDA-graph) batch makes to slot 0)
  [1:3] rid, [3:5] position (KV) or tokens consumed (state) or step (poison)
  [5] layer, [6] component code, [7] chain: the recurrent state's history hash
  [8:] filler mixed from the fields, so every byte of a row depends on its owner.
Reading any row back says whose data it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAG_WIDTH = 8
KIND_ZERO, KIND_KV, KIND_STATE, KIND_POISON, KIND_PADDING = 0, 1, 2, 3, 4
CHAIN_MOD = 251  # prime below 256, so a chain byte is exact in every dtype
# A KV row's chain byte: 0 for the token's KV; this for a draft a tree verify wrote on the branch it then
# rejected (same request, position, layer and component, so a move from that branch is told apart)
REJECTED_DRAFT_CHAIN = 1
CHAIN_MUL = 31

COMPONENT_CODES = {"full.k": 1, "full.v": 2, "swa.k": 3, "swa.v": 4, "mamba.temporal": 5,
                   # MLA's latent and rope parts of one row; DSA's index keys and their scales;
                   # the block scales of a quantised (MXFP8) KV pool
                   "mla.latent": 6, "mla.rope": 7, "dsa.index_k": 8, "dsa.index_scale": 9,
                   "full.k_scale": 10, "full.v_scale": 11, "swa.k_scale": 12, "swa.v_scale": 13,
                   "mla.scale": 14,  # the block scales of an FP4 MLA pool
                   # MiniMax sparse attention's index caches (keys of every sparse layer, values of the K+V group)
                   "msa.index_k": 15, "msa.index_v": 24}
for _i in range(8):
    COMPONENT_CODES[f"mamba.conv{_i}"] = 16 + _i
CODE_NAMES = {v: k for k, v in COMPONENT_CODES.items()}


def component_code(name: str) -> int:
    """Host copies hold device rows: ``host.full.k`` rows carry ``full.k`` tags; a speculative scratch
    step holds state rows: ``mamba.temporal@draft2`` rows carry ``mamba.temporal`` tags."""
    return COMPONENT_CODES[name.removeprefix("host.").partition("@")[0]]


@dataclass(frozen=True, kw_only=True)
class Tag:
    """What a row says about itself."""

    kind: int
    rid: int
    position: int
    layer: int
    component: int
    chain: int = 0

    def describe(self) -> str:
        comp = CODE_NAMES.get(self.component, f"component#{self.component}")
        if self.kind == KIND_KV:
            rejected = ", a draft on the branch the verify rejected" if self.chain == REJECTED_DRAFT_CHAIN else ""
            return f"req {self.rid} pos {self.position} ({comp} layer {self.layer}){rejected}"
        if self.kind == KIND_STATE:
            return f"req {self.rid} gen {self.position} chain {self.chain}"
        if self.kind == KIND_POISON:
            who = "no request" if self.rid == 0xFFFF else f"req {self.rid}"
            return f"poison (freed from {who} at step {self.position})"
        if self.kind == KIND_PADDING:
            return f"padding (dummy write of a padded batch at step {self.position})"
        return "zeros (never written, or cleared)"


def token_id(rid: int, position: int) -> int:
    """The token a request has at a position: fixed, so histories can be recomputed."""
    return (rid * 7919 + position * 104729 + 17) % 1000


def fold_chain(chain: int, rid: int, start: int, end: int) -> int:
    """The recurrent state's history hash after consuming positions ``[start, end)``."""
    for pos in range(start, end):
        chain = (chain * CHAIN_MUL + token_id(rid, pos) + 1) % CHAIN_MOD
    return chain


def chain_affine(rid: int, start: int, end: int) -> tuple[int, int]:
    """``(a, b)`` with ``fold_chain(c, ...) == (a*c + b) % CHAIN_MOD``, for folding on the device."""
    a, b = 1, 0
    for pos in range(start, end):
        a = a * CHAIN_MUL % CHAIN_MOD
        b = (b * CHAIN_MUL + token_id(rid, pos) + 1) % CHAIN_MOD
    return a, b


def encode_rows(fields: torch.Tensor, row_elems: int) -> torch.Tensor:
    """Rows for a batch of tags. ``fields`` is int64 ``[n, 6]``: kind, rid, position, layer,
    component, chain. Returns int64 ``[n, row_elems]`` with values in 0..255."""
    kind, rid, pos, layer, comp, chain = fields.unbind(1)
    head = torch.stack([kind, rid & 0xFF, (rid >> 8) & 0xFF, pos & 0xFF, (pos >> 8) & 0xFF,
                        layer & 0xFF, comp & 0xFF, chain & 0xFF], dim=1)
    seed = ((kind * 1_000_003 + rid) * 1_000_033 + pos) * 1_000_037 + layer * 131 + comp * 17 + chain
    i = torch.arange(1, row_elems - TAG_WIDTH + 1, dtype=torch.int64, device=fields.device)
    x = seed[:, None] * 0x9E3779B1 + i[None, :] * 0x85EBCA6B
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 13)
    return torch.cat([head, x & 0xFF], dim=1)


def decode_row(row: torch.Tensor) -> Tag:
    """Read a tag back from one row (any dtype); used only to explain a mismatch."""
    v = [int(x) for x in row.reshape(-1)[:TAG_WIDTH].to(torch.float64).tolist()]
    return Tag(kind=v[0], rid=v[1] | v[2] << 8, position=v[3] | v[4] << 8, layer=v[5], component=v[6], chain=v[7])


def describe_row(row: torch.Tensor) -> str:
    flat = row.reshape(-1).to(torch.float64)
    if bool((flat == 0).all()):
        return "zeros (never written, or cleared)"
    tag = decode_row(row)
    if tag.kind not in (KIND_KV, KIND_STATE, KIND_POISON, KIND_PADDING) or bool(((flat < 0) | (flat > 255)).any()):
        return "unrecognised bytes (not written by poolfuzz)"
    expected = encode_rows(torch.tensor([[tag.kind, tag.rid, tag.position, tag.layer, tag.component, tag.chain]]),
                           flat.numel())[0].to(torch.float64)
    text = tag.describe()
    return text if torch.equal(expected, flat) else text + ", torn (row partly overwritten)"
