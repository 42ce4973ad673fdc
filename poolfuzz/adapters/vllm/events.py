"""vLLM's KV cache events, replayed as a router replays them, against the prefix cache they describe.

A KV-aware router (and LMCache, Dynamo) learns which blocks a node caches only from the events the
scheduler drains every step (``take_events``): ``BlockStored`` per newly cached block, ``BlockRemoved``
per evicted hash, ``AllBlocksCleared`` on a reset. A stream that disagrees with the cache sends
requests to nodes that lost their prefix, or never to those that have it. The mirror counts the
blocks the stream says are cached under each (group, hash) (vLLM does not de-duplicate: two blocks
may carry one hash, and evicting one of them removes the hash once) and compares the counts with
the block pool's hash map.
"""

from __future__ import annotations

from collections import Counter

from poolfuzz.adapters.vllm.compat import PrefixCacheView


class EventMirror:
    """The cached (group, hash) pairs a consumer of the event stream believes in."""

    def __init__(self, block_pool, utils, events_module):
        self.block_pool = block_pool
        self._view = PrefixCacheView(block_pool)  # what the prefix cache holds, for the comparison
        self._utils = utils  # vllm.v1.core.kv_cache_utils: the hash-key helpers of this release
        self._events = events_module  # vllm.distributed.kv_events
        self.cached: Counter = Counter()  # (group, hash) -> blocks cached under it
        self.problem: str | None = None  # the first disagreement seen (kept: a later step may hide it)

    @staticmethod
    def supported(block_pool, utils, events_module) -> bool:
        """This release names the group in its events and its hash map answers ``contain`` or
        ``get_one_block`` (optional needs in ``compat.NEEDS``), and has the hash-key helpers the comparison uses."""
        stored = getattr(events_module, "BlockStored", None)
        fields = getattr(stored, "__struct_fields__", ())
        return ("group_idx" in fields and hasattr(block_pool, "kv_event_queue")
                and any(hasattr(getattr(block_pool, "cached_block_hash_to_block", None), m)
                        for m in ("contain", "get_one_block"))
                and all(hasattr(utils, f) for f in ("get_block_hash", "get_group_id", "maybe_convert_block_hash")))

    def consume(self, events) -> None:
        ev = self._events
        for event in events:
            if isinstance(event, ev.BlockStored):
                self.cached.update((event.group_idx, h) for h in event.block_hashes)
            elif isinstance(event, ev.BlockRemoved):
                for h in event.block_hashes:
                    key = (event.group_idx, h)
                    if self.cached[key] <= 0 and self.problem is None:
                        self.problem = (f"the KV events remove hash {_short(h)} of group {event.group_idx}, "
                                        "which no event stored")
                    self.cached[key] -= 1
                    if self.cached[key] <= 0:
                        del self.cached[key]
            elif isinstance(event, ev.AllBlocksCleared):
                self.cached.clear()

    def check(self) -> str | None:
        """The first disagreement between the stream consumed so far and the prefix cache (kept once seen: a later
        step may hide it). Its owner calls it once a step, after the step's events are consumed."""
        if self.problem is None:
            self.problem = self._disagreement()
        return self.problem

    def _disagreement(self) -> str | None:
        u = self._utils
        by_key = self._view.keys()
        stray = by_key.pop(None, None)
        if stray:
            return (f"block {stray[0]} carries a block hash, but the prefix cache's hash map does not hold it "
                    "under that hash")
        actual = Counter({(u.get_group_id(k), u.maybe_convert_block_hash(u.get_block_hash(k))): len(ids)
                          for k, ids in by_key.items()})
        if actual == self.cached:
            return None
        for key in sorted(set(actual) | set(self.cached), key=str):
            if actual[key] != self.cached[key]:
                g, h = key
                return (f"the prefix cache holds {actual[key]} block(s) under hash {_short(h)} of group {g}, "
                        f"but the KV events say {self.cached[key]}")
        return None


def _short(h) -> str:
    return h.hex()[:12] if isinstance(h, bytes) else str(h)
