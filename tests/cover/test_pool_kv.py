"""KV pools: buffer layout per dtype, and what each pool's CPU copy carries (SGLang's per-class semantics)."""

import pytest
import torch

from poolfuzz.pools import CONFIGS, build_family
from poolfuzz.pools.kv import (
    CPU_COPY_CHUNK,
    HybridLinearKVPool,
    KVCache,
    MHACpuCopy,
    MHATokenToKVPool,
    SWACpuCopy,
    SWAKVPool,
)
from poolfuzz.pools.mamba import MambaPool
from poolfuzz.pools.swa_allocator import SWATokenAllocator

STORE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
         "fp8_e4m3": torch.uint8}


def mha(*, size=8, page_size=1, dtype="float32", layer_ids=(0, 1), name="full") -> MHATokenToKVPool:
    return MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype, head_num=2, head_dim=8,
                            layer_ids=layer_ids, device="cpu", name=name)


def write_rows(pool: MHATokenToKVPool, slots, base: int) -> None:
    """Row of slot s in layer l holds the constant base + 10*l + s (k) and that + 100 (v); small ints fit every dtype."""
    for local, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
        for s in slots:
            k[s] = base + 10 * local + s
            v[s] = base + 10 * local + s + 100


def row_values(pool: MHATokenToKVPool, slot: int) -> list[tuple[int, int]]:
    """(k, v) constant of a slot's row per layer; -1 if the row is not a constant."""
    out = []
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        kv = [int(t[slot].float().unique()[0]) if t[slot].unique().numel() == 1 else -1 for t in (k, v)]
        out.append(tuple(kv))
    return out


def make_mamba(size=3) -> MambaPool:
    return MambaPool(size=size, num_layers=1, conv_shapes=((6, 3),), temporal_shape=(2, 4, 4),
                     dtype="float32", device="cpu", layer_ids=(2,))


def mamba_value(pool: MambaPool, slot: int) -> set[float]:
    return {float(v) for _, t in pool.state_tensors() for v in t[:, slot].unique()}


class TestMHALayout:
    @pytest.mark.parametrize("dtype", list(STORE))
    @pytest.mark.parametrize("page_size", [1, 4])
    def test_buffers_are_size_plus_page_by_heads_by_dim(self, dtype, page_size):
        """Each layer's K and V buffer is [size+page_size, heads, head_dim] in the store dtype (uint8 for fp8)."""
        pool = mha(size=8, page_size=page_size, dtype=dtype)
        assert pool.store_dtype == STORE[dtype]
        for buf in pool.k_buffer + pool.v_buffer:
            assert tuple(buf.shape) == (8 + page_size, 2, 8)
            assert buf.dtype == STORE[dtype]
            assert not buf.any()

    def test_components_are_k_then_v_per_layer(self):
        """components names K and V of each global layer, in the pool's index space."""
        pool = mha(layer_ids=(0, 3), name="swa")
        assert [(c.name, c.layer, c.space) for c in pool.components()] == [
            ("swa.k", 0, "swa"), ("swa.v", 0, "swa"), ("swa.k", 3, "swa"), ("swa.v", 3, "swa"),
        ]
        assert len(pool.get_contiguous_buf_infos()) == 4

    def test_base_kv_cache_has_no_cpu_copy(self):
        """The abstract base raises NotImplementedError for CPU copies and state buffers."""
        with pytest.raises(NotImplementedError):
            KVCache().get_cpu_copy([1])
        with pytest.raises(NotImplementedError):
            KVCache().load_cpu_copy(None, [1])
        with pytest.raises(NotImplementedError, match="SWA"):
            mha().get_state_buf_infos("SWA")


class TestMHACpuCopy:
    @pytest.mark.parametrize("dtype", list(STORE))
    def test_round_trip_into_different_indices_by_position(self, dtype):
        """Rows of slots [1, 2, 3] loaded into [7, 5, 6] land by position: 1->7, 2->5, 3->6."""
        pool = mha(dtype=dtype)
        write_rows(pool, [1, 2, 3], base=20)
        expected = [row_values(pool, s) for s in (1, 2, 3)]
        copy = pool.get_cpu_copy(torch.tensor([1, 2, 3]))
        assert isinstance(copy, MHACpuCopy) and copy.num_tokens == 3
        write_rows(pool, [1, 2, 3], base=0)  # scribble the originals
        pool.load_cpu_copy(copy, torch.tensor([7, 5, 6]))
        assert [row_values(pool, s) for s in (7, 5, 6)] == expected
        assert row_values(pool, 4) == [(0, 0), (0, 0)]

    def test_copy_does_not_alias_the_pool(self):
        """Mutating the pool after get_cpu_copy leaves the copy unchanged."""
        pool = mha()
        write_rows(pool, [2], base=30)
        copy = pool.get_cpu_copy([2])
        write_rows(pool, [2], base=1)
        pool.load_cpu_copy(copy, [2])
        assert row_values(pool, 2) == [(32, 132), (42, 142)]

    def test_mamba_indices_are_ignored(self):
        """MHA copies carry K and V only; mamba_indices changes nothing."""
        pool = mha()
        write_rows(pool, [1], base=20)
        plain = pool.get_cpu_copy([1])
        with_mamba = pool.get_cpu_copy([1], mamba_indices=torch.tensor([1]))
        assert set(vars(with_mamba)) == {"layers", "num_tokens"}
        assert all(torch.equal(a, b) for la, lb in zip(plain.layers, with_mamba.layers)
                   for ca, cb in zip(la, lb) for a, b in zip(ca, cb))
        pool.load_cpu_copy(with_mamba, [4], mamba_indices=torch.tensor([2]))
        assert row_values(pool, 4) == row_values(pool, 1)

    def test_copies_are_chunked_by_8192_positions(self):
        """8200 positions make two chunks per layer (8192 + 8) and load back in order."""
        n = CPU_COPY_CHUNK + 8
        pool = MHATokenToKVPool(size=n, page_size=1, dtype="float32", head_num=2, head_dim=8,
                                layer_ids=(0,), device="cpu")
        pool.k_buffer[0][1:] = torch.arange(1, n + 1, dtype=torch.float32)[:, None, None]
        copy = pool.get_cpu_copy(torch.arange(1, n + 1))
        assert [c[0].shape[0] for c in copy.layers[0]] == [CPU_COPY_CHUNK, 8]
        pool.k_buffer[0].zero_()
        pool.load_cpu_copy(copy, torch.arange(n, 0, -1))  # reversed destination
        assert pool.k_buffer[0][n, 0, 0].item() == 1.0
        assert pool.k_buffer[0][1, 0, 0].item() == float(n)

    def test_load_of_wrong_length_is_refused(self):
        """Loading a copy of 2 positions into 3 slots fails loudly."""
        pool = mha()
        copy = pool.get_cpu_copy([1, 2])
        with pytest.raises(AssertionError, match="2 backed-up tokens into 3 slots"):
            pool.load_cpu_copy(copy, [3, 4, 5])


def swa_setup(page_size=1):
    """Full pool of 8 (layer 0), SWA pool of 8 (layer 1) and their allocator, mapping registered."""
    kv = SWAKVPool(size=8, size_swa=8, page_size=page_size, dtype="float16", head_num=2, head_dim=8,
                   full_layer_ids=(0,), swa_layer_ids=(1,), device="cpu")
    alloc = SWATokenAllocator(size=8, size_swa=8, page_size=page_size)
    kv.register_mapping(alloc.full_to_swa)
    return kv, alloc


class TestSWAKVPoolCpuCopy:
    def test_copy_carries_full_rows_and_mapped_swa_rows_only(self):
        """Full rows for every position; SWA rows only where the position is still mapped."""
        kv, alloc = swa_setup()
        full = alloc.alloc(4)  # full 1..4 -> SWA 1..4
        alloc.free_swa(full[:2])  # positions 0, 1 slid out of the window
        write_rows(kv.full_kv_pool, [1, 2, 3, 4], base=20)
        write_rows(kv.swa_kv_pool, [3, 4], base=60)
        copy = kv.get_cpu_copy(full)
        assert isinstance(copy, SWACpuCopy)
        assert copy.swa_mask.tolist() == [False, False, True, True]
        assert copy.full.num_tokens == 4 and copy.swa.num_tokens == 2
        assert repr(copy) == "SWACpuCopy(tokens=4, swa_rows=2)"
        # ... and they are the rows of those slots, in position order (one chunk per layer here).
        def constants(part):
            return [[(int(k[i].float().unique()), int(v[i].float().unique())) for i in range(part.num_tokens)]
                    for ((k, v),) in part.layers]

        assert constants(copy.full) == [[(20 + s, 120 + s) for s in (1, 2, 3, 4)]]
        assert constants(copy.swa) == [[(60 + s, 160 + s) for s in (3, 4)]]

    def test_copy_without_any_mapped_position_has_no_swa_part(self):
        """With every position evicted the SWA part is None."""
        kv, alloc = swa_setup()
        full = alloc.alloc(2)
        alloc.free_swa(full)
        assert kv.get_cpu_copy(full).swa is None

    def test_load_restores_swa_only_where_old_and_new_masks_both_map(self):
        """Old mask [F, T, T, T], new mask [T, T, F, T]: SWA rows restored for positions 1 and 3 only."""
        kv, alloc = swa_setup()
        old = alloc.alloc(4)  # full 1..4 -> SWA 1..4
        alloc.free_swa(old[:1])
        write_rows(kv.full_kv_pool, [1, 2, 3, 4], base=20)
        write_rows(kv.swa_kv_pool, [2, 3, 4], base=60)
        full_expected = [row_values(kv.full_kv_pool, s) for s in (1, 2, 3, 4)]
        swa_expected = {pos: row_values(kv.swa_kv_pool, s) for pos, s in ((1, 2), (3, 4))}
        copy = kv.get_cpu_copy(old)
        alloc.free(old)  # full and SWA free lists both [5..8, 1..4] (page size 1 appends)
        new = alloc.alloc(4)  # full 5..8 -> SWA 5..8
        alloc.free_swa(new[2:3])  # position 2 unmapped now
        write_rows(kv.swa_kv_pool, range(1, 9), base=0)  # scribble every SWA row
        swa_before = {s: row_values(kv.swa_kv_pool, s) for s in range(1, 9)}
        kv.load_cpu_copy(copy, new, mamba_indices=torch.tensor([1]))
        assert [row_values(kv.full_kv_pool, s) for s in (5, 6, 7, 8)] == full_expected
        # Position 0: mapped now (SWA 5) but not backed up -> keeps the scribble.
        assert row_values(kv.swa_kv_pool, 5) == swa_before[5]
        assert row_values(kv.swa_kv_pool, 6) == swa_expected[1]
        assert row_values(kv.swa_kv_pool, 8) == swa_expected[3]
        assert {s: row_values(kv.swa_kv_pool, s) for s in (1, 2, 3, 4, 7)} == {
            s: swa_before[s] for s in (1, 2, 3, 4, 7)}

    def test_mamba_indices_are_ignored_by_the_swa_pool(self):
        """swa-ssm: the SWA pool's copy leaves the recurrent state behind, the root of SGLang #35957."""
        family = build_family(CONFIGS["swa-ssm"], device="cpu")
        kv, mamba = family.kv_pool, family.req_pool.mamba_pool
        assert isinstance(kv, SWAKVPool)
        full = family.allocator.alloc(2)
        for _, t in mamba.state_tensors():
            t[:, 1] = 5.0
        copy = kv.get_cpu_copy(full, mamba_indices=torch.tensor([1]))
        assert set(vars(copy)) == {"full", "swa", "swa_mask"}
        for _, t in mamba.state_tensors():
            t[:, 1] = 9.0  # a later owner's state
        kv.load_cpu_copy(copy, full, mamba_indices=torch.tensor([1]))
        assert mamba_value(mamba, 1) == {9.0}

    def test_swa_state_buffers(self):
        """PD reads SWA state buffers from the SWA sub-pool and main KV from the full sub-pool."""
        kv, _ = swa_setup()
        assert kv.get_state_buf_infos("SWA")[0] is kv.swa_kv_pool.k_buffer[0]
        assert kv.get_contiguous_buf_infos()[0] is kv.full_kv_pool.k_buffer[0]
        with pytest.raises(NotImplementedError):
            kv.get_state_buf_infos("MAMBA")


class TestHybridLinearKVPoolCpuCopy:
    def make(self):
        mamba = make_mamba()
        kv = HybridLinearKVPool(size=8, page_size=1, dtype="bfloat16", head_num=2, head_dim=8,
                                full_layer_ids=(0,), device="cpu", mamba_pool=mamba)
        return kv, mamba

    def test_carries_mamba_when_mamba_indices_are_given(self):
        """Slot 1's state travels with the copy and lands in slot 3 on load."""
        kv, mamba = self.make()
        write_rows(kv.full_kv_pool, [1, 2], base=20)
        for _, t in mamba.state_tensors():
            t[:, 1] = 4.0
        copy = kv.get_cpu_copy(torch.tensor([1, 2]), mamba_indices=torch.tensor([1]))
        assert copy.mamba is not None
        for _, t in mamba.state_tensors():
            t[:, 1] = 8.0
        kv.load_cpu_copy(copy, torch.tensor([5, 6]), mamba_indices=torch.tensor([3]))
        assert mamba_value(mamba, 3) == {4.0}
        assert row_values(kv.full_kv_pool, 5) == [(21, 121)]
        assert repr(copy) == "HybridLinearCpuCopy(tokens=2, mamba=True)"

    def test_no_mamba_without_mamba_indices(self):
        """Without mamba_indices the copy has no state and the load touches none."""
        kv, mamba = self.make()
        for _, t in mamba.state_tensors():
            t[:, 1] = 4.0
        copy = kv.get_cpu_copy(torch.tensor([1]))
        assert copy.mamba is None
        kv.load_cpu_copy(copy, torch.tensor([2]), mamba_indices=torch.tensor([2]))
        assert mamba_value(mamba, 2) == {0.0}

    def test_load_without_mamba_indices_leaves_state_alone(self):
        """A copy with state loaded without mamba_indices restores KV only."""
        kv, mamba = self.make()
        for _, t in mamba.state_tensors():
            t[:, 1] = 4.0
        copy = kv.get_cpu_copy(torch.tensor([1]), mamba_indices=torch.tensor([1]))
        kv.load_cpu_copy(copy, torch.tensor([2]))
        assert mamba_value(mamba, 2) == {0.0}

    def test_components_exclude_mamba_and_state_buffers_are_mamba(self):
        """The mamba components belong to the request pool; PD MAMBA buffers come from the mamba pool."""
        kv, mamba = self.make()
        assert {c.space for c in kv.components()} == {"full"}
        assert len(kv.get_state_buf_infos("MAMBA")) == len(mamba.get_state_buf_infos())
        with pytest.raises(NotImplementedError):
            kv.get_state_buf_infos("SWA")


class TestKVCapabilities:
    def test_cpu_copy_carries_mamba_declarations(self):
        """Only HybridLinearKVPool carries recurrent state in its CPU copy.

        If SWAKVPool declared True, the retraction caller would skip its own mamba backup and a
        resumed SWA+SSM request would decode on its slot's previous owner's state (SGLang #35957).
        If HybridLinearKVPool declared False, the state would be copied twice per retraction.
        """
        assert KVCache.cpu_copy_carries_mamba is False
        assert MHATokenToKVPool.cpu_copy_carries_mamba is False
        assert SWAKVPool.cpu_copy_carries_mamba is False
        assert HybridLinearKVPool.cpu_copy_carries_mamba is True

    def test_host_pool_and_state_type_declarations(self):
        """MHA and SWA have host entries; SWA contributes SWA state, HybridLinear contributes MAMBA."""
        assert (KVCache.supports_host_pool_backup, MHATokenToKVPool.supports_host_pool_backup,
                SWAKVPool.supports_host_pool_backup, HybridLinearKVPool.supports_host_pool_backup) == (
                    False, True, True, False)
        assert (MHATokenToKVPool.state_types, SWAKVPool.state_types, HybridLinearKVPool.state_types) == (
            (), ("SWA",), ("MAMBA",))
