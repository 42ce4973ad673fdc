"""Per-slot checksums of component buffers: exact, position-sensitive, one read of every byte.

A row's bytes, zero-padded to a multiple of eight, are read as little-endian 64-bit words
``x_j``; its checksum is

    h = sum_j w_j * x_j   (mod 2**64), reported as a signed int64

with fixed odd weights ``w_j = splitmix64(j) | 1`` (the same weight for word ``j`` of every
row, whatever the row length). Why this formulation:

* **Exact and the same everywhere, by construction.** It is integer arithmetic in the ring
  Z/2**64: wrapping multiplication and addition are associative and commutative there, so
  every summation order, vector width, thread split or GPU reduction tree gives the same bits.
  CPU (numpy's uint64 ``einsum``), CUDA (torch int64 ``mul``/``sum``, which wrap in two's
  complement) and the Python-integer reference in the tests all compute that one number; no
  floating point is involved anywhere, so there is no rounding to disagree about.
* **Every single-bit flip is seen.** Flipping bit ``b`` of word ``j`` changes ``h`` by
  ``+-2**b * w_j``; ``w_j`` is odd, so that is never 0 mod 2**64.
* **Position-sensitive.** Any change confined to one word (a flip, a swap or shift of elements
  inside it) is seen, for the same reason. Changes spread over several words are caught unless
  they cancel mod 2**64: for random odd weights that is a 2**-(64-k) event, where 2**k divides
  every changed word's difference (the blind spot of every linear hash over 2**64: flipping the
  top bit of two different words cancels). A row moved to the wrong slot is caught because rows
  are compared slot by slot against the ledger, and every poolfuzz row carries its owner's tag.
* **Fast: one read of each byte.** On CPU numpy's integer ``einsum`` multiplies and accumulates
  64-bit words in one pass over the buffer, without a widened copy (the int16 -> float64 matmul
  it replaces read 4x the bytes it was given). On CUDA the products of a chunk of rows stay in
  L2 while they are summed, so HBM is read once.
"""

from __future__ import annotations

import numpy as np
import torch

WORD_BYTES = 8
_SEED = 0x5EED_C0DE_F00D_BA5E
_CUDA_CHUNK_BYTES = 32 << 20  # rows per device pass: the products of one chunk stay (mostly) in L2
_np_weights_cache: dict[int, np.ndarray] = {}
_weights_cache: dict[tuple[int, str], torch.Tensor] = {}


def _splitmix64(i: np.ndarray) -> np.ndarray:
    """SplitMix64 of uint64 counters: a fixed, platform-independent weight per word index."""
    with np.errstate(over="ignore"):
        z = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(_SEED)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _np_weights(words: int) -> np.ndarray:
    """uint64 weights ``w_0..w_{words-1}``, all odd; word j's weight never depends on the row length."""
    w = _np_weights_cache.get(words)
    if w is None:
        w = _splitmix64(np.arange(words, dtype=np.uint64)) | np.uint64(1)
        w.setflags(write=False)
        _np_weights_cache[words] = w
    return w


def _weights(words: int, device) -> torch.Tensor:
    """The same weights as int64 (two's complement) on ``device``."""
    key = (words, str(device))
    w = _weights_cache.get(key)
    if w is None:
        w = torch.from_numpy(_np_weights(words).view(np.int64).copy()).to(device)
        _weights_cache[key] = w
    return w


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` of any dtype as int64 words ``[n, words]``: the row bytes, reinterpreted
    little-endian, zero-padded to a multiple of 8 bytes. No copy when the rows are contiguous
    and 8-byte multiples."""
    n = rows.shape[0]
    flat = rows.reshape(n, -1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.shape[1] * flat.element_size()
    if nbytes % WORD_BYTES == 0 and nbytes and _aligned(flat):
        return flat.view(torch.int64)
    raw = flat.view(torch.uint8) if nbytes else flat.new_zeros((n, 0), dtype=torch.uint8)
    pad = -nbytes % WORD_BYTES if nbytes else WORD_BYTES
    padded = torch.zeros((n, nbytes + pad), dtype=torch.uint8, device=rows.device)
    padded[:, :nbytes] = raw
    return padded.view(torch.int64)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % WORD_BYTES == 0


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """int64 checksum of each row of ``rows`` (``[n, ...]``), computed on the rows' device."""
    if rows.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=rows.device)
    return word_checksums(as_words(rows))


def word_checksums(words: torch.Tensor) -> torch.Tensor:
    """Checksums of int64 word rows ``[n, W]`` (see :func:`as_words`)."""
    n, width = words.shape
    if words.device.type == "cpu":
        x = words.numpy().view(np.uint64)
        return torch.from_numpy(_np_checksums(x, _np_weights(width)).view(np.int64))
    return _torch_checksums(words)


def _torch_checksums(words: torch.Tensor) -> torch.Tensor:
    """The device path (any torch device; the tests run it on CPU against numpy): int64
    multiply and sum wrap in two's complement, i.e. compute mod 2**64, in any reduction order."""
    n, width = words.shape
    w = _weights(width, words.device)
    out = torch.empty(n, dtype=torch.int64, device=words.device)
    step = max(1, _CUDA_CHUNK_BYTES // max(1, width * WORD_BYTES))
    for start in range(0, n, step):
        torch.sum(words[start:start + step] * w, dim=1, out=out[start:start + step])
    return out


def _np_checksums(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """uint64 ``x @ w`` mod 2**64. Large inputs: einsum's integer sum-of-products (one pass, no
    temporary, the fastest exact path numpy has); small ones: ``dot``, which starts faster.
    Both wrap, so both give the same bits."""
    if x.size < 1 << 15:
        return x.dot(w)
    return np.einsum("ij,j->i", x, w)


def slot_checksums(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Checksums of ``buffer[slot]`` for each slot, in the order given, on the buffer's device."""
    if slots.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=buffer.device)
    return SlotReader(buffer)(slots)


class SlotReader:
    """Checksums of chosen rows of one buffer, with the word view worked out once.

    On CPU the rows are gathered straight from a numpy view of the buffer's words (no torch
    dispatch per call); elsewhere with one ``index_select``. A page-major buffer (``page_size``
    > 0: ``[pages, page_size, *row]``, see ``Component.at``) is gathered by (page, offset).
    """

    __slots__ = ("buffer", "page_size", "_np_words", "_np_bytes", "_np_w")

    def __init__(self, buffer: torch.Tensor, *, page_size: int = 0):
        self.buffer = buffer
        self.page_size = page_size
        self._np_words = self._np_bytes = self._np_w = None
        if not page_size and buffer.device.type == "cpu" and buffer.shape[0] and buffer.is_contiguous() and buffer.dtype != torch.bool:
            flat = buffer.reshape(buffer.shape[0], -1)
            nbytes = flat.shape[1] * flat.element_size()
            if nbytes and nbytes % WORD_BYTES == 0 and _aligned(flat):
                self._np_words = flat.view(torch.int64).numpy().view(np.uint64)
            elif nbytes:  # rows to pad: gather the bytes, pad the few rows asked for
                self._np_bytes = flat.view(torch.uint8).numpy()
            if nbytes:
                self._np_w = _np_weights(-(-nbytes // WORD_BYTES))

    def words(self, slots) -> np.ndarray | None:
        """The named rows as uint64 words ``[n, W]``, gathered on the host; None off the CPU."""
        if self._np_w is None:
            return None
        if isinstance(slots, torch.Tensor):
            if slots.dtype != torch.int64 or slots.device.type != "cpu":
                slots = slots.to("cpu", torch.int64)
            idx = slots.numpy()
        else:
            idx = np.asarray(slots, dtype=np.int64)
        if self._np_words is not None:
            return self._np_words[idx]
        raw = self._np_bytes[idx]
        padded = np.zeros((raw.shape[0], self._np_w.shape[0] * WORD_BYTES), dtype=np.uint8)
        padded[:, :raw.shape[1]] = raw
        return padded.view(np.uint64)

    def __call__(self, slots) -> torch.Tensor:
        words = self.words(slots)
        if words is not None:
            return torch.from_numpy(_np_checksums(words, self._np_w).view(np.int64))
        if not isinstance(slots, torch.Tensor):
            slots = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        if slots.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.buffer.device)
        slots = slots.to(self.buffer.device)
        if self.page_size:
            return row_checksums(self.buffer[slots // self.page_size, slots % self.page_size])
        return row_checksums(self.buffer.index_select(0, slots))


def reference_checksums(rows: torch.Tensor) -> list[int]:
    """The definition in plain Python integers (slow): what every fast path must reproduce."""
    words = as_words(rows.cpu()).numpy().view(np.uint64)
    w = [int(v) for v in _np_weights(words.shape[1])]
    out = []
    for row in words.tolist():
        value = sum(int(x) * wj for x, wj in zip(row, w)) % (1 << 64)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out
