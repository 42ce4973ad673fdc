"""The shortest program known to show each catalogue fault, kept beside the catalogue for `poolfuzz hunt`."""

from __future__ import annotations

from typing import Callable

from poolfuzz.pools.config import ModelConfig

# The shortest program (engine operations) known to show each fault, kept beside the catalogue so
# `poolfuzz hunt` can say how close a shrink gets: written by hand where the story is short
# (#35957 is admit, prefill, retract, resume), else the best shrink seen over the hunt's seeds. An
# audit that fails while the families are built needs no operation at all.
SHORTEST_KNOWN: dict[str, int] = {
    "swa-ignores-mamba-backup": 4, "host-pool-for-ssm": 0, "mamba-backed-up-twice": 3, "mamba-slot-zero": 0,
    "mamba-not-cleared": 6, "mamba-mapping-not-written": 1, "backup-drops-last-token": 3,
    "backup-includes-unwritten-token": 3,
    "swa-reload-unmapped-rows": 4, "swa-evict-off-by-one": 3, "swa-evicted-seqlen-not-reset": 5,
    "free-swa-keeps-mapping": 3, "paged-free-partial-page": 3, "pd-drops-mamba-fallback": 3, "cow-without-copy": 4,
    "stale-cow-source": 5, "reload-into-old-indices": 4, "mamba-leak-on-abort": 7,
    "allocator-double-free-undetected": 3, "tree-evicts-locked-node": 5, "tree-match-freed-node": 7,
    # Off the named grid, by hand: a request served, retracted and resumed on a config of the shape;
    # the mamba layer map shows at the first prefill (admit, prefill: the best shrink of `hunt --config
    # random --seeds 5`).
    "reload-chunk-at-chunk-number": 4, "mamba-layer-map-contiguous": 2, "host-load-tiles-of-four": 4,
    # A ping-pong slot written twice in a row (3, the best shrink of `hunt --seeds 5`). By `poolfuzz
    # shortest`: one admit, whose release at teardown leaks its track slots (1).
    "track-slots-not-freed": 1, "ping-pong-stuck": 3,
    # The best shrink of `hunt --seeds 5`: a request served, retracted into the host pool and aborted.
    "host-discard-keeps-swa-slots": 3,
    # By hand: a request served, retracted into the host pool and resumed (the load skips layer 2).
    "host-load-stops-at-pool-layer-count": 4,
    # By hand: a request of two tokens served and retracted: its host copy holds its own top layer at
    # position 1's first layer (admit, prefill, retract).
    "host-page-stride-omits-a-layer": 3,
    # By hand: admit, prefill, then one speculative step (that rejects a draft, for the first): 3.
    "spec-commit-last-draft": 3, "spec-commit-batch-position": 3,
    # By `poolfuzz shortest` (every program of its vocabulary, by length): a copy that drops a component is
    # served, retracted, resumed (4; the DSA index scales on pages too); a PD item of the wrong width is served and transferred (3).
    "mla-copy-drops-rope": 4, "mla-pd-item-of-latent-width": 3,
    "hybrid-mla-pd-item-of-head-width": 3, "dsa-copy-drops-index": 4,
    "dsa-index-scales-transposed": 4, "pd-drops-dsa-index": 3, "scaled-copy-drops-scales": 4, "pd-drops-block-scales": 3,
    # By hand: admit, prefill, one tree verify that accepts two drafts (3).
    "scaled-move-drops-scales": 3,
    "quant-store-skips-last-token": 2, "fp4-copy-drops-scales": 4, "fp4-mha-copy-drops-scales": 4,
    "msa-copy-skips-k-only-index": 4,
    # By hand (tests/cover/test_free_patterns.py replays both): a request longer than the window,
    # prefilled, whose grouped release leaks its SWA slots (admit, prefill: 2); one chunk, then the
    # abort (admit, prefill, abort: 3; the hunt's shrinks keep the warm start's request and stop at 4).
    "free-group-drops-swa": 2, "abort-prefill-leaks-last-chunk": 3,
    # By `poolfuzz shortest`: a fork whose pending copy-on-write is released at teardown (admit, prefill,
    # fork: 3); the drain's flush cannot evict the checkpoint it left locked.
    "cow-source-stays-locked": 3,
    # By hand (tests/cover/test_all_swa.py replays it): a request longer than the window, prefilled and
    # decoded once (the window slides), whose release at teardown frees the evicted slots again (3).
    "release-frees-evicted-window": 3,
    # The best shrink of `hunt --seeds 5`: a request served and forked (the tree checkpoints its state), the
    # fork aborted, the source finished, then the flush that leaves the checkpoint's slot taken (6).
    "flush-keeps-state-slots": 6,
}

# Where a shape of config needs a longer program than SHORTEST_KNOWN's: (does the config have the
# shape, the shortest length there, why).
SHORTEST_KNOWN_ON_SHAPE: dict[str, tuple[Callable[[ModelConfig], bool], int, str]] = {
    # A paged free list hands a retracted request's pages straight back to its resume: another
    # request must take them first (admit, admit, prefill, retract, prefill the other, decode, which
    # resumes). `poolfuzz shortest --config dense-ps4 --faults reload-into-old-indices --max-steps 6`
    # runs every program of up to 5 steps first: none fails.
    "reload-into-old-indices": (lambda c: c.page_size > 1, 6, "pages come back to the resume that freed them"),
    # Extra-buffer mode takes three mamba slots per request (the state and two track slots) from a
    # FIFO free list of 10, so a recycled slot reaches a new request later: by hand, admit, prefill,
    # fork, admit, finish the first, admit, prefill (7); `poolfuzz shortest --config hybrid-extra-buffer
    # --faults mamba-not-cleared --max-steps 6` runs 115,266 programs of up to 6 steps: none fails.
    "mamba-not-cleared": (lambda c: c.mamba_track_slots > 0, 7, "three slots per request cycle the free list"),
}


def shortest_known(fault_id: str, config: ModelConfig | None = None) -> int | None:
    """The shortest program known for the fault, on ``config``'s shape where that needs a longer one."""
    shape = SHORTEST_KNOWN_ON_SHAPE.get(fault_id)
    if shape is not None and config is not None and shape[0](config):
        return shape[1]
    return SHORTEST_KNOWN.get(fault_id)
