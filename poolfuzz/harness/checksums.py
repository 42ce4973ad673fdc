"""Per-slot checksums of component buffers: exact, position-sensitive, computed where the buffer lives.

A row's bytes are read as int16 words ``w_j``; its checksum combines two lanes
``sum_j w_j * a_j`` and ``sum_j w_j * b_j`` with fixed odd weights below 2**21. Each lane is
an integer below 2**53, so the float64 dot product that computes it is exact whatever the
summation order: the same value on CPU and CUDA, run after run. Moving or swapping words
inside a row changes it, and rows are compared slot by slot, so a row in the wrong slot is
caught as well.
"""

from __future__ import annotations

import torch

_WEIGHT_BITS = 21
_MAX_WORDS = 1 << (52 - 15 - _WEIGHT_BITS)  # keeps every lane below 2**52: exact in float64
_weights_cache: dict[tuple[int, str], torch.Tensor] = {}


def _weights(words: int, device: torch.device) -> torch.Tensor:
    key = (words, str(device))
    w = _weights_cache.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x5EED + words)
        lanes = torch.randint(1 << 19, 1 << _WEIGHT_BITS, (words, 2), generator=gen, dtype=torch.int64) | 1
        w = lanes.to(torch.float64).to(device)
        _weights_cache[key] = w
    return w


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` of any dtype as int16 words ``[n, words]``, reinterpreting the bytes."""
    flat = rows.reshape(rows.shape[0], -1)
    if flat.element_size() == 1:
        if flat.shape[1] % 2:
            return flat.to(torch.int16)
        flat = flat.contiguous()
    return flat.contiguous().view(torch.int16)


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """int64 checksum of each row of ``rows`` (``[n, ...]``), on the rows' device."""
    words = as_words(rows)
    n_words = words.shape[1]
    if n_words > _MAX_WORDS:
        raise ValueError(f"rows of {n_words} words exceed the exact range ({_MAX_WORDS}); split the row")
    lanes = words.to(torch.float64) @ _weights(n_words, words.device)
    lanes = lanes.to(torch.int64)
    return lanes[:, 0] * 0x100000001B3 + lanes[:, 1]


def slot_checksums(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Checksums of ``buffer[slot]`` for each slot; gathers on the buffer's device."""
    if slots.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=buffer.device)
    return row_checksums(buffer[slots.to(buffer.device)])
