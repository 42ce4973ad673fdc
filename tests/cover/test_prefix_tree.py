"""The built-in prefix tree of recurrent-state checkpoints, and the fork path through it."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.family import build_family
from poolfuzz.pools.mamba import MambaSlotAllocator
from poolfuzz.pools.prefix_tree import MambaPrefixTree
from poolfuzz.pools.reference import ReferenceFamily
from poolfuzz.pools.request import ReqKv


def _tree(size=4):
    return MambaPrefixTree(MambaSlotAllocator(size=size))


class TestTree:
    def test_match_returns_the_inserted_node_and_misses_other_keys(self):
        tree = _tree()
        node = tree.insert((1, 8), tree.alloc_slot())
        assert tree.match((1, 8)) is node
        assert tree.match((1, 9)) is None and tree.match((2, 8)) is None

    def test_eviction_is_least_recently_used_first_and_skips_locked_nodes(self):
        tree = _tree()
        a = tree.insert((1, 1), tree.alloc_slot())
        b = tree.insert((2, 1), tree.alloc_slot())
        c = tree.insert((3, 1), tree.alloc_slot())
        tree.match((1, 1))  # a is now the most recently used
        tree.inc_lock(b)
        assert tree.evict(2) == 2
        assert list(tree.nodes) == [(2, 1)]  # c (oldest unlocked), then a; b is locked
        assert tree.allocator.available_size() == 3
        assert {a.slot, c.slot} <= set(tree.allocator.free_pages())

    def test_alloc_slot_evicts_only_when_nothing_is_free(self):
        tree = _tree(size=2)
        tree.insert((1, 1), tree.alloc_slot())
        tree.insert((2, 1), tree.alloc_slot())
        slot = tree.alloc_slot()  # evicts (1, 1)
        assert list(tree.nodes) == [(2, 1)] and slot not in tree.held_slots()
        tree.inc_lock(tree.nodes[(2, 1)])
        tree.allocator.free([slot])
        tree.alloc_slot()
        with pytest.raises(PoolExhausted) as info:
            tree.alloc_slot()  # the only node left is locked
        assert info.value.space == "mamba"

    def test_unlocking_more_often_than_locking_is_an_error(self):
        tree = _tree()
        node = tree.insert((1, 1), tree.alloc_slot())
        with pytest.raises(PoolError, match="unlocked more often"):
            tree.dec_lock(node)


def _served(family, rid, tokens):
    req = ReqKv(rid=rid, seqlen=tokens + 1)
    family.protocol.admit(req, family)
    family.protocol.extend(req, family, tokens)
    family.protocol.run_deferred_mamba_ops([req], family)
    req.kv_committed_len = tokens
    return req


class TestForkThroughTheTree:
    def test_a_second_fork_at_the_same_length_hits_the_cached_checkpoint(self):
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        pool = family.req_pool.mamba_pool
        src = _served(family, 1, 4)
        pool.temporal[:, src.mamba_pool_idx] = 5.0
        first = ReqKv(rid=2, seqlen=6)
        family.protocol.fork(src, first, family)
        checkpoint = first.mamba_cow_src
        assert family.prefix_tree.nodes[(1, 4)].lock_ref == 1
        family.protocol.run_deferred_mamba_ops([first], family)  # the COW: copied, node unlocked, kept
        assert family.prefix_tree.nodes[(1, 4)].lock_ref == 0
        free_before = family.req_pool.mamba_allocator.available_size()
        pool.temporal[:, src.mamba_pool_idx] = 6.0  # the source decodes on: the checkpoint must not move
        second = ReqKv(rid=3, seqlen=6)
        family.protocol.fork(src, second, family)
        assert second.mamba_cow_src == checkpoint  # a hit: no new checkpoint slot
        assert family.req_pool.mamba_allocator.available_size() == free_before - 1  # its own slot only
        family.protocol.run_deferred_mamba_ops([second], family)
        assert set(pool.temporal[:, second.mamba_pool_idx].unique().tolist()) == {5.0}

    def test_admission_evicts_an_unlocked_checkpoint_and_the_reference_agrees(self):
        config = CONFIGS["hybrid-linear"]  # 4 mamba slots
        family, ref = build_family(config, device="cpu"), ReferenceFamily(config, backup_mode="cpu_tensor")
        src = _served(family, 1, 4)
        ref.admit(1, seqlen=5), ref.extend(1, 4), ref.commit(1, 4)
        dst = ReqKv(rid=2, seqlen=6)
        family.protocol.fork(src, dst, family)
        ref.fork(1, 2, seqlen=6)
        family.protocol.run_deferred_mamba_ops([dst], family)
        ref.extend(2, 5), ref.commit(2, 5)
        _served(family, 3, 1)
        ref.admit(3, seqlen=2)
        assert family.req_pool.mamba_allocator.available_size() == ref.available("mamba") == 0
        family.protocol.admit(ReqKv(rid=4, seqlen=2), family)  # evicts the checkpoint
        ref.admit(4, seqlen=2)
        assert family.prefix_tree.nodes == {} and ref.tree == {}
        assert family.req_pool.mamba_allocator.available_size() == ref.available("mamba") == 0

    def test_a_locked_checkpoint_is_not_evicted_so_admission_is_refused(self):
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        src = _served(family, 1, 4)
        family.protocol.fork(src, ReqKv(rid=2, seqlen=6), family)  # pending COW: the node is locked
        _served(family, 3, 1)
        with pytest.raises(PoolExhausted) as info:
            family.protocol.admit(ReqKv(rid=4, seqlen=2), family)
        assert info.value.space == "mamba"
        assert (1, 4) in family.prefix_tree.nodes

    @pytest.mark.parametrize("fault", ["tree-evicts-locked-node", "tree-match-freed-node"])
    def test_the_tree_faults_hand_out_a_slot_the_tree_gave_away(self, fault):
        family = build_family(CONFIGS["hybrid-linear"], device="cpu", faults=[fault])
        src = _served(family, 1, 4)
        dst = ReqKv(rid=2, seqlen=6)
        family.protocol.fork(src, dst, family)
        if fault == "tree-match-freed-node":
            family.protocol.run_deferred_mamba_ops([dst], family)  # unlocked: evictable
        _served(family, 3, 1)
        late = ReqKv(rid=4, seqlen=2)
        family.protocol.admit(late, family)  # the correct tree refuses (locked) or drops the node
        if fault == "tree-evicts-locked-node":
            assert dst.mamba_cow_src == late.mamba_pool_idx  # the pending COW now reads req 4's slot
        else:
            assert late.mamba_pool_idx in family.prefix_tree.held_slots()  # a node on a reused slot

    def test_a_copy_that_keeps_its_source_locked_pins_the_checkpoint(self):
        """cow-source-stays-locked: after the copy the node is still locked, so admission cannot evict it
        (the correct copy unlocks it: the test above evicts the same checkpoint)."""
        family = build_family(CONFIGS["hybrid-linear"], device="cpu", faults=["cow-source-stays-locked"])
        src = _served(family, 1, 4)
        dst = ReqKv(rid=2, seqlen=6)
        family.protocol.fork(src, dst, family)
        family.protocol.run_deferred_mamba_ops([dst], family)  # copied, but never unlocked
        assert dst.mamba_cow_src is None and family.prefix_tree.nodes[(1, 4)].lock_ref == 1
        _served(family, 3, 1)
        with pytest.raises(PoolExhausted):
            family.protocol.admit(ReqKv(rid=4, seqlen=2), family)
