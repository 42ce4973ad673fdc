"""The reference model of a family on SGLang's unified memory pool (``unified.py``), and the joint budget
SGLang's prefill adder admits by on that pool."""

from __future__ import annotations

from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.reference import ReferenceFamily


def joint_short(family, *, mamba_slots: int, tokens: int) -> PoolExhausted | None:
    """Why SGLang's prefill adder would not admit a request that takes ``mamba_slots`` new state slots and
    ``tokens`` full KV slots now, or None. The adder's two unified-pool terms (``PrefillAdder.__init__``,
    schedule_policy.py): new state slots within ``rem_mamba_slots`` (the mamba side's
    ``schedulable_available_size``), and tokens plus ``mamba_slot_full_token_cost()`` per new slot within
    the full side's ``available_size`` (a state slot eats shared-gap bytes the full side counts as free)."""
    alloc = family.sg_allocator
    mamba = alloc.mamba_allocator.schedulable_available_size()
    if mamba_slots > mamba:
        return PoolExhausted(space="mamba", requested=mamba_slots, available=mamba)
    need = tokens + mamba_slots * alloc.mamba_slot_full_token_cost()
    if need > alloc.available_size():
        return PoolExhausted(space="full", requested=need, available=alloc.available_size())
    return None


class UnifiedReference(ReferenceFamily):
    """The reference model with the full KV and Mamba state sharing one byte buffer.

    Each sub-pool's virtual ids are counted exactly, as the base model counts slots: a space's capacity is
    its allocator's id range (``num_virtual_ids`` less the reserved pages below ``min_page_index``), and
    every id a request takes or gives back moves the count. How many of those ids fit in bytes floats with
    what the other sub-pool holds: an allocation fits where SGLang promises it does, read before the real
    allocation as the scheduler reads it: new state slots by the adder's joint budget (``joint_short``);
    a decode by the allocator's decode gate (``check_decode_capacity``, what ``check_decode_mem`` asks);
    full and SWA KV together by the SWA pair's own gate, ``ensure_capacity`` (it compacts as it decides, as
    the alloc that follows would); full KV alone by the allocator's ``available_size`` (its
    ``schedulable_available_size``, documented ``>= N => alloc(N) succeeds``). The real pools name no
    short side on a byte shortfall (their free ids are not short), so neither does this: "full". An
    allocation promised that then fails, or an id leaked or freed twice, is a mismatch.
    """

    def __init__(self, config, *, backup_mode: str, family, **capabilities):
        super().__init__(config, backup_mode=backup_mode, **capabilities)
        self.family = family
        alloc = family.sg_allocator
        full = alloc.full_attn_allocator
        # the SWA side binds the full side's virtual ids: its units are those ids
        subs = {"full": full, "swa": full, "mamba": getattr(alloc, "mamba_allocator", None)}
        for space in self.capacity:
            if subs.get(space) is not None:
                sub = subs[space]
                self.capacity[space] = (sub.num_virtual_ids - sub.min_page_index) * sub.pool_page_size
                self.free[space] = self.capacity[space] // self._scale(space)

    _decoding = False  # the allocation under way is a decode's: the scheduler's decode gate decides

    def extend(self, rid: int, new_len: int) -> None:
        req = self.requests[rid]
        # the adapter asks ``check_decode_mem`` before a one-token allocation past a prefix (a decode)
        self._decoding = req.allocated > 0 and new_len - req.allocated == 1
        try:
            super().extend(rid, new_len)
        finally:
            self._decoding = False

    def _need(self, needs: dict[str, int]) -> None:
        if needs.get("mamba") and needs.get("rows", 0) <= self.free.get("rows", 0):
            # the adder asks for state slots (``ensure_mamba_capacity``, the mamba side's schedulable size)
            # before it counts any KV: where both sides are short, the scheduler names the state side (seen
            # on 0.5.22, hybrid-linear-ps4: a resume short of both)
            mamba = self.family.sg_allocator.mamba_allocator.schedulable_available_size()
            if needs["mamba"] > mamba:
                raise PoolExhausted(space="mamba", requested=needs["mamba"], available=mamba)
        super()._need(needs)  # the virtual ids, space by space
        tokens = needs.get("full", 0) * self.ps
        if self._decoding:
            # the allocator's own decode gate (what ``check_decode_mem`` calls; the scheduler retracts on
            # a no): on the SWA pair it reads the joint ``available_size``, stricter than the compaction
            # its ``ensure_capacity`` would run
            alloc = self.family.sg_allocator
            if not alloc.check_decode_capacity(num_tokens=tokens, tree_cache=None, requests=[], spec_algorithm=None):
                raise PoolExhausted(space="full", requested=tokens, available=alloc.available_size())
            return
        if needs.get("mamba"):
            short = joint_short(self.family, mamba_slots=needs["mamba"], tokens=tokens)
            if short is not None:
                raise short
            if "full" not in needs:
                return
        alloc = self.family.sg_allocator
        if "swa" in needs:
            # the SWA pairs' gate compacts (and the tri-pool's relieves its float band) as it decides, with
            # no read-only answer that agrees with it (``can_reserve`` is stricter): the gate the alloc runs
            # first, ``ensure_capacity``, decides here, and the alloc then must fit. Asked twice: the
            # tri-pool's gate can refuse what its own flush has just made room for, and the alloc's call
            # comes after the reference's (seen on 0.5.23, swa-ssm)
            swa_tokens = needs["swa"] * self.ps
            if not (alloc.ensure_capacity(tokens, swa_tokens) or alloc.ensure_capacity(tokens, swa_tokens)):
                raise PoolExhausted(space="full", requested=tokens, available=alloc.available_size())
        elif tokens > alloc.available_size():
            raise PoolExhausted(space="full", requested=tokens, available=alloc.available_size())
