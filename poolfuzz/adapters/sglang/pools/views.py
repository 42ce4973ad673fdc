"""Thin views of SGLang's pools and free lists, in the terms the harness reads.

Every tensor behind a view is SGLang's own buffer; the views only translate: ids to Python ints,
free lists to the ``available_size`` / ``is_free_page`` / ``free_pages`` / ``free_list_problem``
queries of the family interface (:mod:`poolfuzz.pools.interface`).
"""

from __future__ import annotations

from typing import Callable

import torch

from poolfuzz.adapters.sglang.pools.reads import mamba_layer_states
from poolfuzz.pools.components import Component
from poolfuzz.pools.mamba import named_state
from poolfuzz.pools.errors import ConfigError


def as_ints(t) -> list[int]:
    if isinstance(t, torch.Tensor):
        return [int(x) for x in t.reshape(-1).tolist()]
    return [int(x) for x in t]


# =============================================================================================
# Free lists
# =============================================================================================
class FreeListView:
    """One SGLang free list, in the units its allocator keeps: pages for token pools, slots else.

    ``available_size`` is SGLang's own answer (token slots for token pools); ``is_free_page`` is what the drivers'
    checks ask of a unit a request holds (a slot in flight listed free).
    """

    def __init__(self, *, space: str, owner, read: Callable[[], list[int]], available: Callable[[], int],
                 page_size: int = 1, sources: Callable[[], list[torch.Tensor]] | None = None):
        self.space = space
        self.owner = owner  # the SGLang object behind this view
        self._read = read
        self._available = available
        self.page_size = page_size
        # The tensors the free list is read from, if it is read from tensors: the set of free units
        # is then rebuilt only when one of them changed (the harness asks is_free_page once per held
        # unit, and a long context holds thousands: one set per query made a step O(tokens * pool)).
        self._sources = sources
        self._cached: tuple[tuple, set[int]] | None = None

    def __repr__(self) -> str:
        return f"FreeListView({self.space} of {type(self.owner).__name__})"

    def available_size(self) -> int:
        return int(self._available())

    def free_pages(self) -> list[int]:
        return self._read()

    def is_free_page(self, unit: int) -> bool:
        return unit in self._free_set()

    def _free_set(self) -> set[int]:
        if self._sources is None:
            return set(self._read())
        # The key holds the tensors themselves, so no id can be reused while it is cached, and a
        # tensor's _version moves with every in-place write: same objects, versions and sizes,
        # same contents.
        key = tuple((t, t._version, t.numel()) for t in self._sources())
        cached = self._cached
        if cached is None or len(cached[0]) != len(key) or any(
                a[0] is not b[0] or a[1:] != b[1:] for a, b in zip(cached[0], key)):
            cached = self._cached = (key, set(self._read()))
        return cached[1]


def token_free_sources(allocator) -> list[torch.Tensor]:
    """The tensors an SGLang token or paged allocator keeps its free pages in (what
    ``token_free_pages`` reads), for change detection."""
    out = [t for t in (getattr(allocator, n, None) for n in ("free_pages", "release_pages"))
           if isinstance(t, torch.Tensor)]
    return out + [t for t in getattr(allocator, "staged_pages", None) or [] if isinstance(t, torch.Tensor)]


def token_free_pages(allocator) -> list[int]:
    """Free pages of an SGLang token or paged allocator, wherever this release keeps them."""
    getter = getattr(allocator, "get_all_free_pages", None)
    if callable(getter):
        return as_ints(getter())
    parts = []
    for name in ("free_pages", "release_pages"):
        t = getattr(allocator, name, None)
        if isinstance(t, torch.Tensor):
            parts.append(t.reshape(-1))
    for t in getattr(allocator, "staged_pages", None) or []:
        parts.append(t.reshape(-1))
    return as_ints(torch.cat(parts)) if parts else []


# =============================================================================================
# Pools as the harness sees them
# =============================================================================================
def mamba_state_tensors(mamba_pool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(conv tensors, temporal) of an SGLang MambaPool, each ``[layers, slots+1, ...]``."""
    cache = mamba_pool.mamba_cache
    if hasattr(cache, "conv"):
        conv, temporal = cache.conv, cache.temporal
    else:  # older releases: a (conv, temporal) tuple
        conv, temporal = cache[0], cache[1]
    if isinstance(conv, torch.Tensor):
        conv = [conv]
    return list(conv), temporal


class MambaPoolView:
    """The recurrent state of SGLang's MambaPool as components; storage is SGLang's.

    ``spec_scratch``: its speculative intermediate caches (``adapters.sglang.speculative``), or None."""

    spec_scratch = None

    def __init__(self, pool, layer_ids: tuple[int, ...], *, req_pool=None):
        self.pool = pool
        self.layer_ids = layer_ids
        self.req_pool = req_pool  # the kernels' door to each layer's state (``reads.mamba_layer_states``)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return named_state(*mamba_state_tensors(self.pool))

    def components(self) -> list[Component]:
        conv, temporal = mamba_state_tensors(self.pool)
        states = mamba_layer_states(self.req_pool, self.layer_ids, conv, temporal)
        # a layer's parts as its kernels reach them: its conv tensors in order, then its temporal state (if any)
        parts = {layer_id: [*convs, layer_temporal] for layer_id, (convs, layer_temporal) in states.items()}
        return [Component(name=name, layer=layer_id, space="mamba", tensor=parts[layer_id][i])
                for i, (name, _) in enumerate(named_state(conv, temporal)) for layer_id in self.layer_ids]


class ReqPoolView:
    """SGLang's (Hybrid)ReqToTokenPool: rows, ``req_to_token`` and, if any, the MambaPool."""

    def __init__(self, pool, *, mamba: MambaPoolView | None, rows: FreeListView, mamba_free: FreeListView | None):
        self.pool = pool
        self.mamba_pool = mamba
        self.rows = rows
        self.mamba_allocator = mamba_free

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.pool.req_to_token

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.pool.req_to_token[row, start:end].to(device="cpu", dtype=torch.int64)

    def get_mamba_indices(self, rows) -> torch.Tensor:
        """SGLang's own ``get_mamba_indices``: what the attention backends index the mamba state by."""
        mapping = self.pool.req_index_to_mamba_index_mapping
        index = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).to(mapping.device)
        return self.pool.get_mamba_indices(index).to(device="cpu", dtype=torch.int64)

    def get_track_slots(self, row: int) -> list[int] | None:
        """Extra-buffer mode: the row's track slots as the attention backend reads them
        (``req_index_to_mamba_ping_pong_track_buffer_mapping``); None without the mode."""
        mapping = getattr(self.pool, "req_index_to_mamba_ping_pong_track_buffer_mapping", None)
        if mapping is None or not getattr(self.pool, "enable_mamba_extra_buffer", False):
            return None
        return [s for s in as_ints(mapping[row]) if s >= 0]

    def available_size(self) -> int:
        return self.pool.available_size()


class KVPoolView:
    """SGLang's KV pool as components. Subclassed per family so that the class attribute
    ``cpu_copy_carries_mamba`` (which the harness audits) and the class name are SGLang's."""

    cpu_copy_carries_mamba = False
    declared = True  # False: SGLang declares nothing; the value was inferred (see build)
    # The forward's KV rows go through SGLang's write door (``write_rows``), not into the buffers
    writes_through_engine = True

    def __init__(self, pool, comps: list[Component], *, door=None):
        self.pool = pool
        self._components = comps
        self._door = door  # rows -> the keys written (adapters.sglang.writes.write_rows, bound to the pool)

    def write_rows(self, slots: torch.Tensor, rows: dict) -> set:
        """Write ``rows[(component, layer)]`` for the full slots ``slots`` as an attention backend does."""
        return self._door(slots=slots, rows=rows) if self._door is not None else set()

    def components(self) -> list[Component]:
        return list(self._components)


class AllocatorView:
    """SGLang's token allocator; ``translate`` maps full slots to SWA slots (0 = unmapped)."""

    def __init__(self, allocator, *, swa: bool):
        self.allocator = allocator
        self.swa = swa

    def translate(self, indices) -> torch.Tensor:
        if not self.swa:
            raise ConfigError("translate() is only defined for SWA families")
        mapping = self.allocator.full_to_swa_index_mapping
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).to(mapping.device)
        return mapping[idx].to(device="cpu", dtype=torch.int64)
