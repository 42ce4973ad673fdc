"""The reference model of vLLM's block accounting: one shared pool of blocks for every group."""

from __future__ import annotations

from poolfuzz.adapters.vllm.api import load
from poolfuzz.adapters.vllm.manager import hash_block_for, num_blocks_for
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.reference import ReferenceFamily, RefRequest, page_floor, pages_spanned

BLOCK_SPACES = ("full", "swa", "mamba")


def mamba_mode_for(config: ModelConfig) -> str:
    """The mamba cache mode a config runs in. A config that keeps states for the prefix cache
    (``mamba_track_slots``: SGLang's extra buffer) runs vLLM's equivalent, "align": a state per
    block of tokens, prefix caching on. Any other: "none", one state block per request, no caching."""
    return "align" if config.mamba_track_slots else "none"


def _blocks(tokens: int, ps: int) -> int:
    return -(-tokens // ps)


class VllmReference(ReferenceFamily):
    """Per-request logical contents as in :class:`ReferenceFamily`; capacity as vLLM counts it.

    Every KV cache group draws blocks from one pool (block 0 is the null block), so a request's
    needs in every group are checked together against the blocks left. A block stays counted
    while a live request's table holds it in any group; a prefix hit revives a cached block, which
    costs a free block as a new one would (a hit is the engine's choice, told to :meth:`resume`).
    vLLM keeps the blocks of rejected draft tokens, and a mamba group in "none" mode holds one
    block per request from its first allocation on.

    In "align" mode a request's mamba table is as long as its tokens' blocks, but only its state
    blocks are real (the rest the null block): an allocation that grows the table past its length
    takes one block, at the index of the last token, and every allocation first frees the state
    blocks before the block of the last computed token (the worker has read them).
    """

    def __init__(self, config: ModelConfig, *, backup_mode: str, **capabilities):
        super().__init__(config, backup_mode=backup_mode, **capabilities)
        self.pool = num_blocks_for(config) - 1
        self.align = config.has_mamba and mamba_mode_for(config) == "align"
        self.adopts = self.align and load().adopts_without_new_tokens  # see VllmAPI
        self.state_blocks: dict[int, set[int]] = {}  # align: rid -> indices of its real state blocks
        self.state_len: dict[int, int] = {}  # align: rid -> its mamba table's length in blocks
        # Hits inside a block (hashes finer than a block, see manager.hash_block_for): a request whose
        # allocation ends at its prompt's last hash boundary inside a block keys its running state
        # block there, and its next allocation first moves that key to a copy (one block more in the
        # check, back in the free queue, cached, once the copy has run).
        self.unit = hash_block_for(load(), config, mamba_mode_for(config)) if self.align else self.ps
        self.prompt_len: dict[int, int] = {}  # rid -> its vLLM request's prompt (for the boundary)
        self.keyed_tail: set[int] = set()  # rids whose running state block is keyed at that boundary
        for space in BLOCK_SPACES:
            if space in self.capacity:
                self.capacity[space] = self.pool * self._scale(space)
                self.free[space] = self.pool

    def _shared_free(self) -> int:
        return self.pool - sum(self.pool - self.free[s] for s in BLOCK_SPACES if s in self.free)

    def available(self, space: str) -> int:
        if space in BLOCK_SPACES:
            return self._shared_free() * self._scale(space)
        return super().available(space)

    def _need(self, needs: dict[str, int]) -> None:
        """The scheduler's order: a free input-batch row first, then blocks for every group at once."""
        super()._need({s: n for s, n in needs.items() if s not in BLOCK_SPACES})
        blocks = sum(n for s, n in needs.items() if s in BLOCK_SPACES)
        if blocks > self._shared_free():
            raise PoolExhausted(space="full", requested=blocks * self.ps, available=self._shared_free() * self.ps)

    def admit(self, rid: int, *, seqlen: int = 0) -> RefRequest:
        """An input-batch row only: the blocks (the state block too) come with the first allocation."""
        req = self.requests.get(rid) or RefRequest(rid=rid)
        self._take({"rows": 1})
        req.seqlen = seqlen
        self.prompt_len[rid] = seqlen
        req.holds_row = True
        req.holds_mamba = False
        req.pending_state = () if self.config.has_mamba else None
        self.requests[rid] = req
        return req

    def _retire_states(self, rid: int, computed: int) -> None:
        """allocate_slots' first act in align mode: the state blocks before the last computed token's go."""
        held = self.state_blocks.get(rid)
        if not held or computed <= 0:
            return
        gone = {i for i in held if i < (computed - 1) // self.ps}
        held -= gone
        self.free["mamba"] += len(gone)

    def _new_state_block(self, rid: int, tokens: int, length: int) -> int:
        """1 if an allocation for ``tokens`` grows a mamba table of ``length`` blocks (one new state block)."""
        return int(_blocks(tokens, self.ps) > length)

    def _hold_state(self, rid: int, states: set[int], length: int, tokens: int) -> None:
        if self._new_state_block(rid, tokens, length):
            states = states | {(tokens - 1) // self.ps}
            length = _blocks(tokens, self.ps)
        self.state_blocks[rid] = states
        self.state_len[rid] = length

    def _keys_tail(self, rid: int, cached: int) -> None:
        """An allocation that caches up to ``cached`` tokens keys the running state block at the
        prompt's last hash boundary when that boundary is ``cached`` and lies inside a block."""
        if self.unit >= self.ps or rid not in self.prompt_len:
            return
        boundary = (self.prompt_len[rid] - 1) // self.unit * self.unit
        if boundary and boundary == cached and boundary % self.ps:
            self.keyed_tail.add(rid)

    def _copy_keyed_tail(self, rid: int, needs: dict[str, int]) -> None:
        """The check of the allocation after ``_keys_tail``: one block more (the key's copy)."""
        if rid in self.keyed_tail:
            self._need({**needs, "mamba": needs.get("mamba", 0) + 1})
            self.keyed_tail.discard(rid)

    def held(self, space: str) -> int:
        if space == "mamba" and self.align:
            return sum(len(s) for s in self.state_blocks.values())
        return super().held(space)

    def release(self, rid: int) -> None:
        self.keyed_tail.discard(rid)
        if self.align:
            self.free["mamba"] += len(self.state_blocks.pop(rid, ()))
            self.state_len.pop(rid, None)
            self.requests[rid].holds_mamba = False
        super().release(rid)

    def extend(self, rid: int, new_len: int) -> None:
        req = self.requests[rid]
        if new_len <= req.allocated:
            return
        if self.align:
            self._retire_states(rid, req.committed)
        pages = pages_spanned(new_len, self.ps) - pages_spanned(req.allocated, self.ps)
        needs = {"full": pages}
        if self.config.has_swa:
            needs["swa"] = pages
        if self.align:
            needs["mamba"] = self._new_state_block(rid, new_len, self.state_len.get(rid, 0))
        elif self.config.has_mamba and not req.holds_mamba:
            needs["mamba"] = 1
        self._copy_keyed_tail(rid, needs)
        self._take(needs)
        req.allocated = new_len
        req.holds_mamba = self.config.has_mamba
        if self.align:
            self._hold_state(rid, self.state_blocks.get(rid, set()), self.state_len.get(rid, 0), new_len)
            self._keys_tail(rid, min(new_len, req.seqlen))

    def free_speculative_tail(self, rid: int) -> None:
        """vLLM rolls back ``num_computed_tokens`` only: the blocks stay with the request."""

    def resume(self, rid: int, *, hit: int = 0, external: int = 0, hit_state: bool | None = None) -> None:
        """Recompute after preemption, as the scheduler schedules it: a row, blocks for every token up
        to the last sampled one (null SWA blocks for the prefix outside the window) and a state block;
        the KV of ``[0, seqlen - 1)`` is then there again (found, loaded or recomputed)."""
        req = self.requests[rid]
        n = req.backup_tokens
        # align: the last token's slot comes with the next decode, unless nothing before it is left
        slots = n if self.align and (hit + external < n or self.adopts) else n + 1
        needs = {"rows": 1, "full": pages_spanned(slots, self.ps)}
        swa_lo = 0
        if self.config.has_swa:
            swa_lo = page_floor(max(0, hit + external - self.config.sliding_window), self.ps)
            needs["swa"] = pages_spanned(slots, self.ps) - swa_lo // self.ps
        states, length = set(), 0
        if self.align:
            # The state the lookup ends on: the connector's (loaded into a new block at the last
            # external token) or the local hit's cached block (revived); then the running state's block.
            if external:
                states, length = {(hit + external - 1) // self.ps}, _blocks(hit + external, self.ps)
            elif hit:
                states, length = {(hit - 1) // self.ps}, _blocks(hit, self.ps)
            needs["mamba"] = len(states) + self._new_state_block(rid, slots, length)
            if hit % self.ps:
                # A hit inside a block (never with connector tokens): each group copies the hit's
                # tail block on write. The check counts the copy and the hit's block it reads, which
                # returns to the free queue (cached) once the copy has run.
                self._need({**needs, "full": needs["full"] + 1, "mamba": needs["mamba"] + 1})
            # vLLM's admission check counts a first allocation's mamba blocks as one new block (its cap
            # without speculative blocks) plus the hit's state block (evictable, in the free queue),
            # whatever the allocation then takes. With a hit and connector tokens that end in the last
            # token's block, the hit is superseded and never touched: the check asks one block more
            # than the allocation takes, and the request waits. With connector tokens and no hit, the
            # allocation takes two (the loaded state's block and the running state's) where the check
            # counted one: near capacity vLLM raises "Cannot get 1 free blocks from the pool", a real
            # defect (vllm#46892, open); the reference predicts exhaustion, so the crash is reported.
            counted = 1 + int(hit > 0 if hit_state is None else hit_state)
            if counted > needs["mamba"] and not hit % self.ps:
                self._need({**needs, "mamba": counted})
        elif self.config.has_mamba:
            needs["mamba"] = 1
        self._take(needs)
        if self.align:
            self._hold_state(rid, states, length, slots)
            self._keys_tail(rid, slots)  # a next turn cached up to its last prompt token's boundary
        req.holds_row = True
        req.holds_mamba = self.config.has_mamba
        req.allocated = slots
        req.committed = n
        req.swa_lo = swa_lo
        req.backup_tokens = None

    def next_turn(self, rid: int, *, seqlen: int, kv_owner: tuple[int, ...], state, hit: int = 0,
                  external: int = 0, hit_state: bool | None = None) -> None:
        """A finished request's next turn, scheduled as a resume of ``seqlen - 1`` tokens: its hit
        blocks are cached blocks in the free queue (each finished request continues once, so no live
        request holds them), and cost a free block as a new one would."""
        self.requests[rid] = RefRequest(rid=rid, seqlen=seqlen, backup_tokens=seqlen - 1)
        self.prompt_len[rid] = seqlen
        try:
            self.resume(rid, hit=hit, external=external, hit_state=hit_state)
        except PoolExhausted:
            del self.requests[rid]
            del self.prompt_len[rid]
            raise
        req = self.requests[rid]
        req.kv_owner = list(kv_owner)
        req.state = state
