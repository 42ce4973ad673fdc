"""MambaPool storage: zeroed at creation, never zeroed by alloc/free, and CPU copies that never alias."""

import torch

from poolfuzz.pools.mamba import MambaCpuCopy, MambaPool, MambaSlotAllocator, cpu_copy
from poolfuzz.pools.req_to_token import HybridReqToTokenPool


def make_pool(size: int = 3) -> MambaPool:
    """Two mamba layers (global ids 3, 4), conv tensors of (6, 3) and (4, 3), temporal (2, 4, 4)."""
    return MambaPool(size=size, num_layers=2, conv_shapes=((6, 3), (4, 3)), temporal_shape=(2, 4, 4),
                     dtype="float32", device="cpu", layer_ids=(3, 4))


def fill(pool: MambaPool, slot: int, value: float) -> None:
    for _, t in pool.state_tensors():
        t[:, slot] = value


def slot_values(pool: MambaPool, slot: int) -> set[float]:
    """The distinct values a slot holds across every state tensor and layer."""
    return {float(v) for _, t in pool.state_tensors() for v in t[:, slot].unique()}


class TestMambaPoolLayout:
    def test_created_zeroed_with_slot_zero_reserved(self):
        """Every tensor is [layers, size+1, *shape] and all zeros at creation."""
        pool = make_pool()
        assert [tuple(c.shape) for c in pool.conv] == [(2, 4, 6, 3), (2, 4, 4, 3)]
        assert tuple(pool.temporal.shape) == (2, 4, 2, 4, 4)
        assert all(t.dtype == torch.float32 and not t.any() for _, t in pool.state_tensors())

    def test_state_dtype_is_honoured(self):
        """bfloat16 state is stored as bfloat16."""
        pool = MambaPool(size=1, num_layers=1, conv_shapes=((6, 3),), temporal_shape=(2, 4, 4),
                         dtype="bfloat16", device="cpu", layer_ids=(0,))
        assert pool.temporal.dtype == torch.bfloat16

    def test_components_name_each_tensor_and_global_layer(self):
        """components yields one view per (state tensor, layer), addressed by mamba slot."""
        pool = make_pool()
        comps = pool.components()
        assert [(c.name, c.layer, c.space) for c in comps] == [
            ("mamba.conv0", 3, "mamba"), ("mamba.conv0", 4, "mamba"),
            ("mamba.conv1", 3, "mamba"), ("mamba.conv1", 4, "mamba"),
            ("mamba.temporal", 3, "mamba"), ("mamba.temporal", 4, "mamba"),
        ]
        comps[-1].tensor[2] = 5.0  # a view: writes land in the pool
        assert float(pool.temporal[1, 2].max()) == 5.0
        assert repr(comps[0]) == "Component(mamba.conv0 layer 3, mamba x4)"

    def test_state_buf_infos_are_one_buffer_per_tensor_and_layer(self):
        """PD registers (state tensor, layer) buffers, each indexed by slot."""
        bufs = make_pool().get_state_buf_infos()
        assert [tuple(b.shape) for b in bufs] == [(4, 6, 3), (4, 6, 3), (4, 4, 3), (4, 4, 3), (4, 2, 4, 4), (4, 2, 4, 4)]


class TestMambaPoolNoZeroing:
    def test_reallocating_a_slot_keeps_the_old_state(self):
        """Neither free nor alloc zeroes: the next owner of slot 1 sees the previous owner's state."""
        pool = make_pool(size=1)
        alloc = MambaSlotAllocator(size=1)
        slot = alloc.alloc_one()
        assert slot == 1
        fill(pool, slot, 7.0)
        alloc.free([slot])
        assert alloc.alloc_one() == 1
        assert slot_values(pool, 1) == {7.0}

    def test_hybrid_request_pool_alloc_does_not_zero(self):
        """HybridReqToTokenPool.alloc_mamba hands out a stale slot; only clear_slots zeroes."""
        pool = make_pool(size=1)
        req_pool = HybridReqToTokenPool(size=2, max_context=4, device="cpu", mamba_pool=pool)
        row = req_pool.alloc()
        slot = req_pool.alloc_mamba(row)
        assert int(req_pool.req_to_mamba[row]) == slot == 1
        fill(pool, slot, 3.0)
        req_pool.free_mamba(row, slot)
        assert int(req_pool.req_to_mamba[row]) == 0
        assert req_pool.alloc_mamba(row) == 1
        assert slot_values(pool, 1) == {3.0}

    def test_clear_slots_zeroes_only_the_given_slots(self):
        """clear_slots([2]) zeroes slot 2 in every tensor and leaves slots 1 and 3."""
        pool = make_pool()
        for slot in (1, 2, 3):
            fill(pool, slot, float(slot))
        pool.clear_slots([2])
        assert [slot_values(pool, s) for s in (1, 2, 3)] == [{1.0}, {0.0}, {3.0}]

    def test_copy_from(self):
        """copy_from copies every state tensor of the source slot into the destination slot."""
        pool = make_pool()
        fill(pool, 1, 4.0)
        fill(pool, 3, 9.0)
        pool.copy_from([1], [3])
        assert [slot_values(pool, s) for s in (1, 2, 3)] == [{4.0}, {0.0}, {4.0}]


class TestMambaCpuCopy:
    def test_cpu_copy_helper_never_aliases_on_cpu(self):
        """cpu_copy of a CPU tensor is a new tensor with its own storage (plain .to('cpu') is the same tensor)."""
        t = torch.arange(4.0)
        assert t.to("cpu") is t
        c = cpu_copy(t)
        assert c is not t
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        t[0] = 100.0
        assert c.tolist() == [0.0, 1.0, 2.0, 3.0]

    def test_get_cpu_copy_does_not_alias_the_live_slot(self):
        """Mutating the pool after get_cpu_copy leaves the copy unchanged."""
        pool = make_pool()
        fill(pool, 2, 6.0)
        copy = pool.get_cpu_copy(torch.tensor([2]))
        assert isinstance(copy, MambaCpuCopy)
        fill(pool, 2, -1.0)
        assert {float(v) for v in copy.temporal.unique()} == {6.0}
        assert all({float(v) for v in c.unique()} == {6.0} for c in copy.conv)
        assert [tuple(c.shape) for c in copy.conv] == [(2, 1, 6, 3), (2, 1, 4, 3)]
        assert tuple(copy.temporal.shape) == (2, 1, 2, 4, 4)
        assert repr(copy) == "MambaCpuCopy(slots=1)"

    def test_load_cpu_copy_round_trips_into_another_slot(self):
        """A copy of slot 1 loaded into slot 3 makes slot 3 equal to slot 1 as it was."""
        pool = make_pool()
        for i, (_, t) in enumerate(pool.state_tensors()):
            t[:, 1] = torch.arange(t[:, 1].numel(), dtype=t.dtype).reshape(t[:, 1].shape) + 10 * i
        expected = [t[:, 1].clone() for _, t in pool.state_tensors()]
        copy = pool.get_cpu_copy([1])
        fill(pool, 1, 0.0)
        pool.load_cpu_copy(copy, [3])
        assert all(torch.equal(t[:, 3], e) for (_, t), e in zip(pool.state_tensors(), expected))
        assert slot_values(pool, 1) == {0.0}
        assert slot_values(pool, 2) == {0.0}
