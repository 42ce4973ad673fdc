"""A prefix tree of recurrent-state checkpoints: match, insert, lock and unlock, LRU eviction under pressure.

SGLang's mamba radix cache keeps, at a node, the recurrent state after the node's tokens (a
checkpoint in a mamba slot of its own). A request that matches the node locks it (``inc_lock_ref``)
until its first extend forward has copied the checkpoint into its own slot (the copy-on-write);
unlocked nodes stay cached, and are evicted least recently used first when a mamba slot is
needed and none is free (``ensure_mamba_capacity`` / ``evict``).

A node is keyed by the request whose state it checkpoints and the tokens that state consumed:
``(rid, committed)``. A request's state only moves forward, so the key names one state.
"""

from __future__ import annotations

from dataclasses import dataclass

from poolfuzz.pools.errors import PoolError, PoolExhausted

Key = tuple[int, int]  # (rid of the request checkpointed, tokens its state consumed)


@dataclass(kw_only=True)
class TreeNode:
    key: Key
    slot: int  # the mamba slot holding the checkpoint (owned by the tree)
    lock_ref: int = 0  # requests that matched the node and have not copied it yet
    last_access: int = 0  # the tree's clock at insert or last match

    def __repr__(self) -> str:
        return f"TreeNode({self.key}, slot {self.slot}, locks {self.lock_ref})"


class MambaPrefixTree:
    """The checkpoints a node's prefix cache holds, over the node's mamba slot allocator."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.nodes: dict[Key, TreeNode] = {}
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, key: Key) -> TreeNode | None:
        """The node checkpointing ``key``, touched for LRU; None on a miss."""
        node = self.nodes.get(key)
        if node is not None:
            node.last_access = self._tick()
        return node

    def insert(self, key: Key, slot: int) -> TreeNode:
        node = TreeNode(key=key, slot=slot, last_access=self._tick())
        self.nodes[key] = node
        return node

    def inc_lock(self, node: TreeNode) -> None:
        node.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> None:
        if node.lock_ref <= 0:
            raise PoolError(f"{node}: unlocked more often than locked")
        node.lock_ref -= 1

    def node_of_slot(self, slot: int) -> TreeNode | None:
        return next((n for n in self.nodes.values() if n.slot == slot), None)

    def evictable(self) -> list[TreeNode]:
        """Unlocked nodes, least recently used first."""
        return sorted((n for n in self.nodes.values() if self.may_evict(n)), key=lambda n: (n.last_access, n.key))

    def may_evict(self, node: TreeNode) -> bool:
        return node.lock_ref == 0

    def evict(self, num: int) -> int:
        """Evict up to ``num`` nodes, least recently used first; returns how many were evicted."""
        victims = self.evictable()[:max(num, 0)]
        for node in victims:
            self.drop(node)
        return len(victims)

    def drop(self, node: TreeNode) -> None:
        """Remove the node and free its slot."""
        del self.nodes[node.key]
        self.allocator.free([node.slot])

    def ensure_free(self, num: int) -> None:
        """Evict so that ``num`` slots are free, if the tree can (``ensure_mamba_capacity``)."""
        short = num - self.allocator.available_size()
        if short > 0:
            self.evict(short)

    def alloc_slot(self) -> int:
        """A mamba slot, evicting one unlocked node first if none is free."""
        self.ensure_free(1)
        if self.allocator.available_size() < 1:
            raise PoolExhausted(space="mamba", requested=1, available=0)
        return self.allocator.alloc_one()

    def flush(self) -> None:
        """Evict every unlocked node (an idle server's cache flush)."""
        self.evict(len(self.nodes))

    def reset(self) -> list[int]:
        """Drop every node without freeing its slot (``RadixCache.reset`` in a cache flush: the pools are
        reset in place next); returns the slots the tree held."""
        slots = self.held_slots()
        self.nodes.clear()
        return slots

    def held_slots(self) -> list[int]:
        return [n.slot for n in self.nodes.values()]
