"""Reference model of a family: plain Python, no tensors; capacity and each request's logical contents.

It predicts which operations exhaust which pool, and what every live request should hold:
for each KV position, whose token it is; for the recurrent state, after how many tokens and
along which token history. The harness compares the real family against it after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import PoolExhausted


def pages_spanned(n: int, ps: int) -> int:
    """The pages of ``ps`` tokens that ``n`` tokens span (the last one partly filled)."""
    return -(-n // ps)


def page_floor(n: int, ps: int) -> int:
    """``n`` rounded down to a whole number of pages of ``ps`` tokens."""
    return n // ps * ps


Segment = tuple[int, int, int]  # (rid, start, end): that request's tokens at positions [start, end)


@dataclass(kw_only=True)
class RefRequest:
    rid: int
    seqlen: int = 0
    allocated: int = 0  # positions with KV slots
    committed: int = 0  # positions whose KV was written
    swa_lo: int = 0  # SWA slots are held for positions [swa_lo, allocated)
    holds_row: bool = False
    holds_mamba: bool = False
    kv_owner: list[int] = field(default_factory=list)  # per committed position: rid whose token it is
    # The recurrent state as the tokens it consumed, in order; None while no state is defined
    # (a fresh slot before its first extend clears it, or a pending copy-on-write).
    state: tuple[Segment, ...] | None = None
    pending_state: tuple[Segment, ...] | None = None  # applied at the first extend: () = clear, else COW
    # Extra-buffer mode: what each track slot holds (a state history as above; None until a forward
    # wrote it), and how many forwards wrote one
    track: list = field(default_factory=list)
    track_writes: int = 0
    # Speculative decoding: what each draft step of the request's scratch row holds (a state history;
    # None until a verify wrote it since the request took its row)
    scratch: list = field(default_factory=list)
    backup_tokens: int | None = None  # tokens in the retraction backup, None if not retracted
    cow_key: tuple[int, int] | None = None  # the prefix-tree node a pending copy-on-write has locked
    host_held: dict[str, int] = field(default_factory=dict)


class ReferenceFamily:
    """Counts free rows / pages / slots per space exactly as the real allocators must."""

    def __init__(self, config: ModelConfig, *, backup_mode: str, resume_swa_tail_only: bool = True):
        c = config
        self.config = c
        self.ps = c.page_size
        self.backup_mode = backup_mode
        # Paged SWA: a resume gives SWA slots to the window tail only (the family's capability of
        # that name); else to every position of the prompt, as releases without the tail alloc do.
        self.resume_swa_tail_only = resume_swa_tail_only
        # Each space's size in the real allocator's units (slots); counted below in pages for
        # the device token spaces, which are allocated and freed by the page.
        self.capacity = c.device_capacity()
        if backup_mode == "host_pool":
            self.capacity["host.full"] = c.host_size
            if c.has_swa:
                self.capacity["host.swa"] = c.host_size
        self.free = {space: n // self._scale(space) for space, n in self.capacity.items()}
        self.requests: dict[int, RefRequest] = {}
        # The prefix tree's recurrent-state checkpoints: (rid, tokens) -> [lock count, last access],
        # evicted least recently used first, as the real tree does (poolfuzz.pools.prefix_tree).
        self.tree: dict[tuple[int, int], list[int]] = {}
        self.clock = 0
        self.state_slots = 1 + c.mamba_track_slots  # mamba slots a live request holds

    def _scale(self, space: str) -> int:
        return self.ps if space in ("full", "swa") else 1

    def total(self, space: str) -> int:
        """The space's size in the units ``free`` counts."""
        return self.capacity[space] // self._scale(space)

    def available(self, space: str) -> int:
        """In the real allocator's units: slots (pages x page size for token pools)."""
        return self.free[space] * self._scale(space)

    def _need(self, needs: dict[str, int]) -> None:
        """Raise as the real family would, checking spaces in the order it allocates them."""
        for space, n in needs.items():
            if n > self.free.get(space, 0):
                raise PoolExhausted(space=space, requested=n * self._scale(space), available=self.available(space))

    def _ensure_mamba(self, n: int) -> None:
        """Evict unlocked checkpoints, least recently used first, until ``n`` mamba slots are free."""
        short = n - self.free.get("mamba", 0)
        victims = sorted((v[1], k) for k, v in self.tree.items() if v[0] == 0)[:max(short, 0)]
        for _, key in victims:
            del self.tree[key]
            self.free["mamba"] += 1

    def flush_prefix_cache(self) -> None:
        self._ensure_mamba(self.free.get("mamba", 0) + len(self.tree))

    def flush_cache(self) -> None:
        """An idle node's cache flush: the prefix tree is gone and every pool is whole again."""
        self.tree.clear()
        self.free = {space: self.total(space) for space in self.capacity}

    def _unlock(self, req: RefRequest) -> None:
        if req.cow_key is not None and req.cow_key in self.tree:
            self.tree[req.cow_key][0] -= 1
        req.cow_key = None

    def _kv_pages(self, pages: int) -> dict[str, int]:
        """``pages`` of each token space the model has (full, SWA or both), in the order they are allocated."""
        return {space: pages for space, has in (("full", self.config.has_full), ("swa", self.config.has_swa)) if has}

    def _take(self, needs: dict[str, int]) -> None:
        self._need(needs)
        for space, n in needs.items():
            self.free[space] -= n

    # --- queries ------------------------------------------------------------------------------
    def request(self, rid: int) -> RefRequest:
        """What a live request should hold (read it, never write it: the operations below do)."""
        return self.requests[rid]

    def live(self):
        """The rids of live requests, retracted ones included (a read-only view)."""
        return self.requests.keys()

    # --- operations -------------------------------------------------------------------------
    def admit(self, rid: int, *, seqlen: int = 0) -> RefRequest:
        """A row (and a fresh mamba slot, evicting a checkpoint if none is free) for a new request."""
        req = self.requests.get(rid) or RefRequest(rid=rid)
        self._need({"rows": 1})
        if self.config.has_mamba:
            self._ensure_mamba(self.state_slots)
        self._take({"rows": 1, **({"mamba": self.state_slots} if self.config.has_mamba else {})})
        req.seqlen = seqlen
        req.holds_row = True
        req.holds_mamba = self.config.has_mamba
        self._fresh_track(req)
        req.pending_state = () if self.config.has_mamba else None
        self.requests[rid] = req
        return req

    def fork(self, src_rid: int, rid: int, *, seqlen: int | None = None) -> RefRequest:
        """A new request whose prefix is the source's committed tokens (shared KV, COW state).

        Needs a row, a mamba slot for itself and, unless the prefix tree holds a checkpoint of
        the source at this length (a hit, locked first), one for a new checkpoint; then full and
        SWA pages for the prefix.
        """
        src = self.requests[src_rid]
        prefix = src.committed
        key = (src_rid, prefix)
        hit = self.config.has_mamba and key in self.tree
        if hit:
            self.clock += 1
            self.tree[key][0] += 1
            self.tree[key][1] = self.clock
        pages = pages_spanned(prefix, self.ps)
        needs = {"rows": 1}
        if self.config.has_mamba:
            needs["mamba"] = self.state_slots if hit else self.state_slots + 1  # and a new checkpoint
        needs.update(self._kv_pages(pages))
        try:
            self._need({"rows": 1})
            if self.config.has_mamba:
                self._ensure_mamba(needs["mamba"])
            self._take(needs)
        except PoolExhausted:
            if hit:
                self.tree[key][0] -= 1
            raise
        req = RefRequest(rid=rid, holds_row=True, holds_mamba=self.config.has_mamba, allocated=prefix,
                         committed=prefix, seqlen=prefix if seqlen is None else seqlen,
                         kv_owner=list(src.kv_owner[:prefix]))
        if self.config.has_mamba:
            if not hit:
                self.clock += 1
                self.tree[key] = [1, self.clock]
            req.cow_key = key
            req.pending_state = src.state
        self._fresh_track(req)
        self.requests[rid] = req
        if self.config.has_swa:
            self.evict_swa(rid, prefix)
        return req

    def _fresh_track(self, req: RefRequest) -> None:
        """New track slots: nothing written to them yet."""
        req.track = [None] * (self.config.mamba_track_slots if req.holds_mamba else 0)
        req.track_writes = 0
        req.scratch = [None] * (self.config.spec_draft_tokens if req.holds_mamba else 0)

    def verify(self, rid: int, start: int, end: int) -> None:
        """A target-verify forward over ``[start, end)``: draft step t of the scratch row holds the state
        after position ``start + t`` (the commit that follows picks the accepted one)."""
        req = self.requests[rid]
        if not req.scratch:
            return
        for t in range(end - start):
            req.scratch[t] = req.state + ((rid, start, start + t + 1),)

    def commit(self, rid: int, end: int) -> None:
        """KV written for positions ``[committed, end)``; the state consumed those tokens."""
        req = self.requests[rid]
        start = req.committed
        req.kv_owner.extend([rid] * (end - start))
        if self.config.has_mamba:
            if req.pending_state is not None:  # the extend forward ran the deferred clear / COW
                self._unlock(req)  # a copied checkpoint stays cached in the tree, unlocked
                req.state = req.pending_state
                req.pending_state = None
            req.state = req.state + ((rid, start, end),)
            if req.track:  # the forward also leaves its state in the next track slot
                req.track[req.track_writes % len(req.track)] = req.state
                req.track_writes += 1
        req.committed = end

    def sample(self, rid: int, tokens: int = 1) -> None:
        """A forward sampled ``tokens`` new tokens (committed KV comes later, with the next forward)."""
        self.requests[rid].seqlen += tokens

    def adopt(self, rid: int, source: RefRequest) -> None:
        """PD: the request pre-allocated here receives the source node's tokens and state."""
        req = self.requests[rid]
        req.seqlen = source.seqlen
        req.kv_owner = list(source.kv_owner)
        req.state = source.state

    def extend(self, rid: int, new_len: int) -> None:
        req = self.requests[rid]
        if new_len <= req.allocated:
            return
        pages = pages_spanned(new_len, self.ps) - pages_spanned(req.allocated, self.ps)
        self._take(self._kv_pages(pages))
        req.allocated = new_len

    def free_speculative_tail(self, rid: int) -> None:
        """Rejected draft tokens give back every page past the one holding the last committed token."""
        req = self.requests[rid]
        keep = min(req.allocated, pages_spanned(req.committed, self.ps) * self.ps)
        freed = pages_spanned(req.allocated, self.ps) - pages_spanned(keep, self.ps)
        for space, n in self._kv_pages(freed).items():
            self.free[space] += n
        req.allocated = keep

    def evict_swa(self, rid: int, pre_len: int) -> None:
        if not self.config.has_swa:
            return
        req = self.requests[rid]
        new = page_floor(max(req.swa_lo, pre_len - self.config.sliding_window), self.ps)
        if new > req.swa_lo:
            self.free["swa"] += (new - req.swa_lo) // self.ps
            req.swa_lo = new

    def release(self, rid: int) -> None:
        req = self.requests[rid]
        if self.config.has_full:
            self.free["full"] += pages_spanned(req.allocated, self.ps)
        if self.config.has_swa:
            self.free["swa"] += pages_spanned(req.allocated, self.ps) - req.swa_lo // self.ps
        if req.holds_mamba:
            self.free["mamba"] += self.state_slots
            req.track, req.track_writes, req.scratch = [], 0, []
        self._unlock(req)  # a copy-on-write that never ran: its checkpoint stays cached
        req.pending_state = None
        self.free["rows"] += 1
        req.holds_row = req.holds_mamba = False
        req.allocated = req.committed = req.swa_lo = 0

    def host_needs(self, n: int) -> dict[str, int]:
        needs = {"host.full": pages_spanned(n, self.ps) * self.ps}
        if self.config.has_swa:
            start = page_floor(max(0, n - self.config.sliding_window), self.ps)
            needs["host.swa"] = pages_spanned(n - start, self.ps) * self.ps
        return needs

    def retract(self, rid: int) -> None:
        """Back up (host slots in host_pool mode; may raise PoolExhausted), then release."""
        req = self.requests[rid]
        n = req.seqlen - 1
        if self.backup_mode == "host_pool":
            needs = self.host_needs(n)
            self._take(needs)
            req.host_held = needs
        req.backup_tokens = n
        self.release(rid)

    def discard(self, rid: int) -> None:
        req = self.requests.pop(rid)
        for space, n in req.host_held.items():
            self.free[space] += n

    def pre_alloc(self, rid: int, fill_len: int) -> RefRequest:
        """Row, mamba slot and KV for ``[0, fill_len)``; a new request is registered only if they fit."""
        req = self.requests.get(rid) or RefRequest(rid=rid)
        c = self.config
        needs = {"rows": 1}
        if c.has_mamba:
            needs["mamba"] = self.state_slots
            self._need({"rows": 1})
            self._ensure_mamba(self.state_slots)
        if c.has_full:
            needs["full"] = pages_spanned(fill_len, self.ps)
        swa_lo = 0
        if c.has_swa:
            if self.ps > 1 and self.resume_swa_tail_only:
                swa_lo = page_floor(max(0, fill_len - c.sliding_window), self.ps)
            needs["swa"] = pages_spanned(fill_len - swa_lo, self.ps)
        self._take(needs)
        self.requests[rid] = req
        req.holds_row = True
        req.holds_mamba = c.has_mamba
        self._fresh_track(req)
        req.allocated = req.committed = fill_len
        req.swa_lo = swa_lo
        return req

    def resume(self, rid: int) -> None:
        req = self.requests[rid]
        self.pre_alloc(rid, req.backup_tokens)
        for space, n in req.host_held.items():
            self.free[space] += n
        req.host_held = {}
        req.backup_tokens = None

    def finish(self, rid: int) -> None:
        self.release(rid)
        del self.requests[rid]

    # --- what a request should hold -------------------------------------------------------------
    def held(self, space: str) -> int:
        """Units of ``space`` held by live requests, backups and the prefix tree (free + held == total)."""
        total = len(self.tree) if space == "mamba" else 0
        for req in self.requests.values():
            if space == "rows":
                total += req.holds_row
            elif space == "mamba":
                total += req.holds_mamba * self.state_slots
            elif space == "full":
                total += pages_spanned(req.allocated, self.ps)
            elif space == "swa":
                total += pages_spanned(req.allocated, self.ps) - req.swa_lo // self.ps if req.allocated else 0
            else:
                total += req.host_held.get(space, 0)
        return total
