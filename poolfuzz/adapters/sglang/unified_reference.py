"""The reference model of a family on SGLang's unified memory pool (``unified.py``)."""

from __future__ import annotations

from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.reference import ReferenceFamily


class UnifiedReference(ReferenceFamily):
    """The reference model with the full KV and Mamba state sharing one byte buffer.

    Each sub-pool's virtual ids are counted exactly, as the base model counts slots: a space's capacity is
    its allocator's id range (``num_virtual_ids`` less the reserved pages below ``min_page_index``), and
    every id a request takes or gives back moves the count. How many of those ids fit in bytes floats with
    what the other sub-pool holds; whether an allocation fits is the unified allocator's own capacity view
    (``schedulable_available_size``, which SGLang documents as ``>= N => alloc(N) succeeds``), read before
    the real allocation, as the scheduler reads it. An allocation it promised that then fails, or an id
    leaked or freed twice, is a mismatch.
    """

    def __init__(self, config, *, backup_mode: str, family, **capabilities):
        super().__init__(config, backup_mode=backup_mode, **capabilities)
        self.family = family
        alloc = family.sg_allocator
        for space, sub in (("full", alloc.full_attn_allocator), ("mamba", alloc.mamba_allocator)):
            self.capacity[space] = (sub.num_virtual_ids - sub.min_page_index) * sub.pool_page_size
            self.free[space] = self.capacity[space] // self._scale(space)

    def _need(self, needs: dict[str, int]) -> None:
        for space, n in needs.items():
            units = n * self._scale(space)
            if n > self.free.get(space, 0) or units > self.family.schedulable(space):
                raise PoolExhausted(space=space, requested=units, available=self.available(space))
