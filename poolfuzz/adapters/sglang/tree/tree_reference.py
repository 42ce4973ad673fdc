"""The reference model of a family with SGLang's prefix tree in front of its pools (``trees.py``)."""

from __future__ import annotations

from poolfuzz.adapters.sglang.tree import tree_swa
from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.reference import ReferenceFamily, RefRequest, pages_spanned


class TreeReference(ReferenceFamily):
    """The reference model with a prefix tree in front of the full pool.

    Rows are counted as the base model counts them. Full KV is counted as SGLang's tree would leave it:
    each live request holds privately the pages past its protected prefix; the tree holds what its own
    accounting says (``evictable_size + protected_size``); the rest must be free. An allocation
    succeeds if it fits in the free pages plus what the tree may evict. The tree's sizes and each
    request's protected length are read from the real tree: this audits that the allocator, the
    requests' rows and the tree's accounting add up, not which nodes the tree chose to keep.

    SWA is counted the same way (a request holds the window past its protected prefix and its frontier,
    which is read from the real request: the tree's checkpoints move it); mamba slots are the live
    requests' plus the tree's checkpoints, in a pool sized by ``trees.tree_sized``.
    """

    def __init__(self, config, *, backup_mode: str, family, **capabilities):
        super().__init__(config, backup_mode=backup_mode, **capabilities)
        self.family = family
        if config.has_mamba:  # the pool as the configurator sized it for the tree (``tree_sized``)
            self.capacity["mamba"] = self.free["mamba"] = family.config.mamba_slots

    def _private_pages(self) -> int:
        protocol = self.family.protocol
        total = 0
        for rid, req in self.requests.items():
            if not req.holds_row:
                continue
            sg = protocol.standins.get(rid)
            protected = int(sg.kv.cache_protected_len) if sg is not None and sg.kv is not None else 0
            total += pages_spanned(req.allocated, self.ps) - protected // self.ps
        return total

    def request(self, rid: int) -> RefRequest:
        """The request, with its SWA frontier as the real one stands: under a tree it moves where
        the tree's checkpoints and the scheduler's trigger move it (the SWA free count still checks
        what it freed)."""
        req = super().request(rid)
        sg = self.family.protocol.standins.get(rid)
        if self.config.has_swa and req.holds_row and sg is not None and sg.kv is not None:
            req.swa_lo = tree_swa.frontier(self.family, sg)
        return req

    def evict_swa(self, rid: int, pre_len: int) -> None:
        """The frontier is read from the real request (``request``); the count from the tree."""

    def available(self, space: str) -> int:
        if space == "swa":  # the live requests' window and the tree's SWA are held
            held, _ = self.family.tree_swa()
            return (self.total("swa") - tree_swa.private_swa_pages(self)) * self.ps - held
        if space == "mamba":  # the live requests' state slots and the tree's checkpoints are held
            held, _ = self.family.tree_mamba()
            holders = sum(req.holds_mamba for req in self.requests.values())
            return self.total("mamba") - holders * self.state_slots - held
        if space != "full":
            return super().available(space)
        held, _ = self.family.tree_sizes()
        return (self.total("full") - self._private_pages()) * self.ps - held

    _gate_counts_full_evictable_only = False

    def pre_alloc(self, rid: int, fill_len: int):
        """A resume's pre-allocation. On the PD decode server without SWA tail pre-allocation (page size
        1) SGLang's queue gate budgets one side, ``available_size() + _radix_full_evictable()``, and its
        ``_pre_alloc`` reclaims no SWA: what the tree could free of SWA alone does not count."""
        from poolfuzz.adapters.sglang.disaggregation import prealloc

        fam = self.family
        self._gate_counts_full_evictable_only = bool(
            fam.pd_decode and self.config.has_swa and not prealloc.swa_reserved_apart(fam))
        try:
            return super().pre_alloc(rid, fill_len)
        finally:
            self._gate_counts_full_evictable_only = False

    def _ensure_mamba(self, n: int) -> None:
        """The tree evicts its own checkpoints (``available`` reads what it holds)."""

    def _need(self, needs: dict[str, int]) -> None:
        for space, n in needs.items():
            if space == "full":
                _, evictable = self.family.tree_sizes()
                have = self.available("full") + evictable
                if n * self.ps > have:
                    raise PoolExhausted(space=space, requested=n * self.ps, available=self.available(space))
            elif space == "swa":
                _, evictable = self.family.tree_swa()
                if self._gate_counts_full_evictable_only:
                    from poolfuzz.adapters.sglang.disaggregation import prealloc

                    # what the gate counts, ``_radix_full_evictable``: an all-SWA tree's full_evictable_size is 0
                    evictable = prealloc.radix_evictable(self.family.tree, self.family)
                if n * self.ps > self.available("swa") + evictable:
                    raise PoolExhausted(space=space, requested=n * self.ps, available=self.available(space))
            elif space == "mamba":
                _, evictable = self.family.tree_mamba()
                if n > self.available("mamba") + evictable:
                    raise PoolExhausted(space=space, requested=n, available=self.available(space))
            elif n > self.free.get(space, 0):
                raise PoolExhausted(space=space, requested=n * self._scale(space), available=self.available(space))

    def _need_past_hit(self, pages: int, evictable: int, swa_evictable: int) -> None:
        """Token pages past a locked hit: against the free slots and what the tree may evict with the hit
        locked (``evictable``), in the space the tree's values are (full KV, or an all-SWA model's window);
        beside full KV, SWA pages against the free SWA and the SWA evictable under the same lock."""
        space = "full" if self.config.has_full else "swa"
        if pages * self.ps > self.available(space) + evictable:
            raise PoolExhausted(space=space, requested=pages * self.ps, available=self.available(space))
        if self.config.has_full and self.config.has_swa:
            # the SWA the allocation may evict is counted with the hit locked too (the probe's): the lock
            # protects the hit's window (seen on swa, seed 3: a fork after a host_pool resume)
            if pages * self.ps > self.available("swa") + swa_evictable:
                raise PoolExhausted(space="swa", requested=pages * self.ps, available=self.available("swa"))

    def fork(self, src_rid: int, rid: int, *, seqlen: int | None = None) -> RefRequest:
        """A row, and full pages for the source's committed tokens the tree does not match (the
        match is the tree's: asked first, as the scheduler's policy asks before the adder locks)."""
        src = self.requests[src_rid]
        prefix = src.committed
        seqlen = prefix if seqlen is None else seqlen
        hit, evictable, swa_evictable = self.family.protocol.peek_hit(self.family, src_rid, prefix, seqlen)
        mamba = self.config.has_mamba
        pages = pages_spanned(prefix, self.ps) - hit // self.ps
        self._need({"rows": 1, **({"mamba": self.state_slots} if mamba else {})})
        # the hit is locked before the allocation: what the tree may evict for it excludes the hit itself
        self._need_past_hit(pages, evictable, swa_evictable)
        self.free["rows"] -= 1
        req = RefRequest(rid=rid, holds_row=True, holds_mamba=mamba, allocated=prefix, committed=prefix,
                         seqlen=seqlen, kv_owner=list(src.kv_owner[:prefix]))
        if mamba:
            # The state is the source's after ``prefix`` tokens either way: copied from the hit's
            # checkpoint at the first extend forward (a hit on the whole prefix), or copied (or, with
            # no hit, cleared) and then carried through the recomputed tokens right away.
            if hit < prefix:
                req.state = src.state
            else:
                req.pending_state = src.state
        self._fresh_track(req)
        self.requests[rid] = req
        return req

    def next_turn(self, rid: int, *, seqlen: int, kv_owner, state, hit: int = 0, host: int = 0,
                  evictable: int = 0, swa_evictable: int = 0) -> RefRequest:
        """A finished request's next turn (``SGLangTreeProtocol.begin_turn``), counted as a fork is: a row
        (and a state slot), then full (and SWA) pages for every prompt token but the last that the
        device hit does not cover. A host hit after it costs the same pages (the load-back allocates
        them, or, declined, the recompute does); what the tree may evict for them excludes the device
        hit, which is locked first (the probe's ``evictable``)."""
        loaded = seqlen - 1
        mamba = self.config.has_mamba
        pages = pages_spanned(loaded, self.ps) - hit // self.ps
        self._need({"rows": 1, **({"mamba": self.state_slots} if mamba else {})})
        self._need_past_hit(pages, evictable, swa_evictable)
        self.free["rows"] -= 1
        req = RefRequest(rid=rid, holds_row=True, holds_mamba=mamba, allocated=loaded, committed=loaded,
                         seqlen=seqlen, kv_owner=list(kv_owner))
        if mamba and hit >= loaded:  # the whole prompt but its last token hit: the copy waits for the forward
            req.pending_state = state
        else:  # copied (or cleared) and carried through the recomputed tokens right away
            req.state = state
        self._fresh_track(req)
        self.requests[rid] = req
        return req
