"""One small object per kind of state a request holds: how it is addressed, held, expected and blamed.

The engine and its checks never branch on a space's name: each index space of a family is mapped
once, by :func:`state_types_for`, to the object that knows its rules (as vLLM gives each attention
type its own single-type manager). A new kind of state (an MLA latent, an NSA index buffer, an
extra-buffer mamba slot) is one more class here and one entry in ``KINDS``.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

import numpy as np
import torch

from poolfuzz.pools.req_to_token import HybridReqToTokenPool, ReqToTokenPool
from poolfuzz.pools.swa_allocator import SWATokenAllocator

NO_POSITION = np.array([-1], dtype=np.int64)  # a per-request state has no token position


class SlotLookup:
    """Reads a request's token slots (and their SWA peers) as int64 numpy arrays. The stock
    host-side pools are read in place through a cached numpy view: no tensor op per read."""

    def __init__(self):
        self._views: dict[int, tuple] = {}  # id(host tensor) -> (tensor kept alive, its numpy view)

    def _view(self, tensor: torch.Tensor) -> np.ndarray:
        view = self._views.get(id(tensor))
        if view is None:
            view = self._views[id(tensor)] = (tensor, tensor.numpy())
        return view[1]

    def tokens(self, fam, row: int, lo: int, hi: int) -> np.ndarray:
        """``req_pool.read(row, lo, hi)``."""
        pool = fam.req_pool
        if type(pool).read is ReqToTokenPool.read and pool.req_to_token.device.type == "cpu":
            return self._view(pool.req_to_token)[row, lo:hi].astype(np.int64)
        return pool.read(row, lo, hi).cpu().numpy()

    def mamba_slot(self, fam, row: int) -> int | None:
        """``req_pool.get_mamba_indices([row])``: the row's mamba slot as the kernels read it (None: the
        family's kernels find the state another way and expose no row mapping)."""
        pool = fam.req_pool
        reader = getattr(type(pool), "get_mamba_indices", None)
        if reader is None:
            return None
        if reader is HybridReqToTokenPool.get_mamba_indices and pool.req_to_mamba.device.type == "cpu":
            return int(self._view(pool.req_to_mamba)[row])
        return int(pool.get_mamba_indices([row])[0])

    def track_slots(self, fam, row: int) -> list[int] | None:
        """``req_pool.get_track_slots(row)``: extra-buffer mode's track slots of the row as the kernels read
        them (None: the family keeps no such mapping)."""
        reader = getattr(fam.req_pool, "get_track_slots", None)
        return None if reader is None else reader(row)

    def swa_slots(self, fam, tokens: np.ndarray) -> np.ndarray:
        """``allocator.translate(tokens)``: the SWA slot of each full slot, 0 where unmapped."""
        alloc = fam.allocator
        if type(alloc).translate is SWATokenAllocator.translate and alloc.full_to_swa.device.type == "cpu":
            return self._view(alloc.full_to_swa)[tokens]
        return alloc.translate(torch.from_numpy(tokens)).cpu().numpy()


class StateType:
    """The rules of one index space. Class attributes are capabilities the checks read."""

    space: str = ""
    on_device: ClassVar[bool] = True  # counts toward pool pressure; host copies do not
    reserves_zero: ClassVar[bool] = True  # slot/page 0 is padding: never handed out, never free
    recurrent: ClassVar[bool] = False  # one state per request, rewritten by every forward
    # Its components are per-row scratch: speculative decoding's intermediate state, one row per request
    # row, draft step by step (poolfuzz.pools.speculative)
    scratch: ClassVar[bool] = False
    # Its slots are what ``req_to_token`` holds (the space a request's token positions are allocated in;
    # every family has one: full KV, or an all-SWA model's window)
    row_addressed: ClassVar[bool] = False

    def held_units(self, lookup: SlotLookup, fam, kv, tokens: np.ndarray) -> list[int]:
        """The units (pages, slots or rows) a live request holds in this space."""
        return []

    def snapshot(self, lookup: SlotLookup, fam, kv, tokens: np.ndarray):
        """What the request's slots are now, kept to say "was slot N before" after a move."""
        return None

    def consumer_problem(self, lookup: SlotLookup, fam, kv, tokens: np.ndarray) -> tuple[str, int] | None:
        """Where a mapping the model's kernels (or the release path) read to find this request's state
        disagrees with what the request holds: (what is wrong, the slot), or None. ``tokens`` are the
        full slots of positions ``[0, kv_allocated_len)``."""
        return None

    def slot_before(self, snapshot, position: int | None) -> int | None:
        return None


class RequestRows(StateType):
    """A request's row of ``req_to_token``."""

    space = "rows"
    scratch = True

    def held_units(self, lookup, fam, kv, tokens):
        return [kv.req_pool_idx]


class FullKV(StateType):
    """Full-attention KV: one slot per position, from position 0, addressed by the row's token slots."""

    space = "full"
    row_addressed = True

    def first_position(self, config, committed: int) -> int:
        """The first position whose KV a live request must still hold."""
        return 0

    def physical(self, lookup: SlotLookup, fam, tokens: np.ndarray) -> np.ndarray:
        """The slot in this space of each token slot."""
        return tokens

    def write_targets(self, fam, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def unmapped(self, slots: np.ndarray) -> int | None:
        """The index of the first position without a slot in this space, if any."""
        return None

    def held_units(self, lookup, fam, kv, tokens):
        """The units of the request's own positions (a protected prefix is the prefix tree's)."""
        ps = fam.config.page_size
        return sorted({t // ps for t in tokens[kv.cache_protected_len:].tolist()})

    def locate(self, lookup: SlotLookup, fam, req, config) -> tuple[np.ndarray, np.ndarray]:
        """(positions, slots) the request's components of this space must hold their data in."""
        committed = req.kv.kv_committed_len
        lo = self.first_position(config, committed)
        tokens = lookup.tokens(fam, req.kv.req_pool_idx, lo, committed)
        return np.arange(lo, committed), self.physical(lookup, fam, tokens)

    def describe_expected(self, ledger, ref, position: int) -> str:
        return f"req {ref.kv_owner[position]} pos {position}"

    def snapshot(self, lookup, fam, kv, tokens):
        return self.physical(lookup, fam, tokens).tolist()

    def slot_before(self, snapshot, position):
        return snapshot[position] if position is not None and position < len(snapshot) else None


class SlidingWindowKV(FullKV):
    """SWA KV: positions inside the window only, each mapped from its full slot by ``full_to_swa``."""

    space = "swa"
    row_addressed = False

    def first_position(self, config, committed):
        return max(0, committed - config.sliding_window)

    def physical(self, lookup, fam, tokens):
        return lookup.swa_slots(fam, tokens)

    def write_targets(self, fam, slots):
        return fam.allocator.translate(slots)

    def unmapped(self, slots):
        missing = np.flatnonzero(slots <= 0)
        return int(missing[0]) if missing.size else None

    def held_units(self, lookup, fam, kv, tokens):
        ps = fam.config.page_size
        return sorted({t // ps for t in self.physical(lookup, fam, tokens[kv.cache_protected_len:]).tolist() if t > 0})

    def consumer_problem(self, lookup, fam, kv, tokens):
        """Every held position not yet evicted (``[swa_evicted_seqlen, kv_allocated_len)``, the window and the
        slots allocated ahead of it alike) has an SWA slot in ``full_to_swa``: the forward writes through it."""
        lo = kv.swa_evicted_seqlen
        if kv.cache_protected_len > lo:
            # A prefix tree's SWA before the window may be a tombstone (the tree freed it; the match
            # needs only the window live): what the forwards read of the protected prefix is the window.
            lo = max(lo, min(kv.cache_protected_len, self.first_position(fam.config, kv.kv_committed_len)))
        slots = self.physical(lookup, fam, tokens[lo:])
        missing = np.flatnonzero(slots <= 0)
        if not missing.size:
            return None
        position = lo + int(missing[0])
        return (f"position {position} (full slot {int(tokens[position])}) is held and not evicted (evicted up to "
                f"{lo}, allocated {kv.kv_allocated_len}) but full_to_swa maps it to no SWA slot",
                int(tokens[position]))


class WindowOnlyKV(SlidingWindowKV):
    """An all-SWA model's KV (no full attention): ``req_to_token`` holds the SWA slots themselves
    (``full_to_swa`` is the identity). A position the window evicted is freed while the row keeps its
    stale slot, so a request holds only ``[max(cache_protected_len, swa_evicted_seqlen), kv_allocated_len)``."""

    row_addressed = True

    def held_units(self, lookup, fam, kv, tokens):
        ps = fam.config.page_size
        lo = max(kv.cache_protected_len, kv.swa_evicted_seqlen)
        return sorted({t // ps for t in self.physical(lookup, fam, tokens[lo:]).tolist() if t > 0})


class RecurrentState(StateType):
    """Mamba conv and temporal state: one slot per request. A pending copy-on-write source is a
    prefix-tree checkpoint: the tree holds it (:class:`CachedPrefixes`), the request only reads it."""

    space = "mamba"
    recurrent = True

    def held_units(self, lookup, fam, kv, tokens):
        return ([kv.mamba_pool_idx] if kv.mamba_pool_idx is not None else []) + list(kv.mamba_track)

    def locate(self, lookup, fam, req, config) -> tuple[np.ndarray, np.ndarray]:
        return NO_POSITION, np.array([req.kv.mamba_pool_idx], dtype=np.int64)

    def consumer_problem(self, lookup, fam, kv, tokens):
        """The row's mamba slot as the kernels read it (``get_mamba_indices``) is the slot the request holds;
        so are its track slots, where the family maps them per row."""
        if kv.mamba_pool_idx is None:
            return None
        mapped = lookup.mamba_slot(fam, kv.req_pool_idx)
        if mapped is None or mapped == kv.mamba_pool_idx:
            return self._track_problem(lookup, fam, kv)
        return (f"row {kv.req_pool_idx}'s mamba slot as the kernels read it (get_mamba_indices) is {mapped}, but "
                f"the request holds slot {kv.mamba_pool_idx}: its forward would read and write slot {mapped}",
                kv.mamba_pool_idx)

    def _track_problem(self, lookup, fam, kv):
        if not kv.mamba_track:
            return None
        mapped = lookup.track_slots(fam, kv.req_pool_idx)
        if mapped is None or list(mapped) == list(kv.mamba_track):
            return None
        wrong = next((s for s in kv.mamba_track if s not in mapped), kv.mamba_track[0])
        return (f"row {kv.req_pool_idx}'s track slots as the kernels read them are {list(mapped)}, but the request "
                f"holds {list(kv.mamba_track)}: its forward would track its state elsewhere", wrong)

    def tracked(self, req, ref) -> list[tuple[int, tuple]]:
        """Extra-buffer mode: (track slot, the state history it must hold) of each track slot a
        forward wrote; a slot not written since it was allocated holds nothing to check."""
        return [(slot, history) for slot, history in zip(req.kv.mamba_track, ref.track) if history is not None]

    def describe_expected(self, ledger, ref, position) -> str:
        return ledger.describe_state(ref.state)

    def snapshot(self, lookup, fam, kv, tokens):
        return kv.mamba_pool_idx

    def slot_before(self, snapshot, position):
        return snapshot


class HostCopy(StateType):
    """A host pool holding retraction backups; its slot 0 is an ordinary slot."""

    on_device = False
    reserves_zero = False

    def __init__(self, space: str):
        self.space = space

    def describe_expected(self, ledger, ref, position: int) -> str:
        return f"req {ref.kv_owner[position]} pos {position}"


class CachedPrefixes:
    """What a family's prefix cache holds for itself (checkpoints no request owns), by index space.

    Each cached unit is held once, never free, as a request's units are. A family without a prefix
    cache has no ``cached_units`` and holds nothing here.
    """

    def held_units(self, caps) -> dict[str, list[int]]:
        """``caps``: the family's Capabilities (its ``cached_units``, where it has a prefix cache)."""
        return caps.cached_units() if caps.cached_units is not None else {}


KINDS: dict[str, type[StateType]] = {"rows": RequestRows, "full": FullKV, "swa": SlidingWindowKV,
                                     "mamba": RecurrentState}
HOST_PREFIX = "host."


def state_types_for(spaces: Iterable[str]) -> dict[str, StateType]:
    """The state type of each index space a family has (its free lists' keys). SWA KV without a full
    space beside it is an all-SWA model's window-only KV."""
    spaces = list(spaces)
    kinds = dict(KINDS) if "full" in spaces else {**KINDS, "swa": WindowOnlyKV}
    out = {}
    for space in spaces:
        if space in kinds:
            out[space] = kinds[space]()
        elif space.startswith(HOST_PREFIX):
            out[space] = HostCopy(space)
        else:
            raise ValueError(f"index space {space!r} has no state type; add one to poolfuzz.harness.state_types")
    return out
