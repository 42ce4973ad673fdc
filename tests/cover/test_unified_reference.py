"""The unified pool's reference asks SGLang's gates in the scheduler's order
(adapters/sglang/unified_pool/unified_reference.py).

The allocator here is a stand-in with the three read-only sizes the reference reads, so the order of the
questions can be set up exactly: no SGLang is imported.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poolfuzz.adapters.sglang.unified_pool.unified_reference import UnifiedReference
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import PoolExhausted


def _sub(ids: int, page_size: int):
    return SimpleNamespace(num_virtual_ids=ids, min_page_index=1, pool_page_size=page_size)


def _reference(*, schedulable_mamba: int, full_available: int) -> UnifiedReference:
    config = CONFIGS["hybrid-linear-ps4"]
    mamba = _sub(config.mamba_slots + 1, 1)
    mamba.schedulable_available_size = lambda: schedulable_mamba
    alloc = SimpleNamespace(full_attn_allocator=_sub(config.full_tokens // config.page_size + 1, config.page_size),
                            mamba_allocator=mamba, available_size=lambda: full_available,
                            mamba_slot_full_token_cost=lambda: 0)
    return UnifiedReference(config, backup_mode="cpu_tensor", family=SimpleNamespace(sg_allocator=alloc))


def test_short_of_both_sides_names_the_state_side_the_adder_asks_first():
    """A resume short of full pages (no free ids) and of schedulable state slots: SGLang's adder asks
    ``ensure_mamba_capacity`` before it counts KV, so the refusal names mamba (0.5.22, hybrid-linear-ps4)."""
    ref = _reference(schedulable_mamba=0, full_available=0)
    ref.free["full"] = 0
    with pytest.raises(PoolExhausted) as info:
        ref.pre_alloc(1, 9)
    assert info.value.space == "mamba"


def test_a_state_slot_that_fits_leaves_the_kv_count_to_name_the_shortfall():
    ref = _reference(schedulable_mamba=4, full_available=0)
    ref.free["full"] = 0
    with pytest.raises(PoolExhausted) as info:
        ref.pre_alloc(1, 9)
    assert info.value.space == "full"


def test_no_free_row_is_named_before_the_state_side():
    ref = _reference(schedulable_mamba=0, full_available=0)
    ref.free["rows"] = 0
    with pytest.raises(PoolExhausted) as info:
        ref.pre_alloc(1, 9)
    assert info.value.space == "rows"
