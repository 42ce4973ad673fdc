"""SGLang's FP4 MHA KV cache (``dense-fp4``): packed K and V with a scale row each, built as the release builds it
for ``--kv-cache-dtype fp4_mx_block16`` (adapters/sglang/pools/mha_fp4.py), its four buffers checksummed components."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS

NAMES = ["dense-fp4", "dense-fp4-ps4"]


def _family(name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(why)
    return build_family(CONFIGS[name])


@pytest.mark.parametrize("name", NAMES)
def test_the_four_buffers_are_the_release_s_own(api, name):
    fam = _family(name)
    pool = fam.sg_kv_pool
    by_key = {(c.name, c.layer): c.tensor for c in fam.components()}
    for layer in CONFIGS[name].full_layer_ids:
        for comp, buf in (("full.k", pool.k_buffer), ("full.v", pool.v_buffer), ("full.k_scale", pool.k_scale_buffer),
                          ("full.v_scale", pool.v_scale_buffer)):
            assert by_key[(comp, layer)].data_ptr() == buf[layer].data_ptr(), (comp, layer)
    assert tuple(by_key[("full.k_scale", 0)].shape[1:]) == (12,)  # 2 heads x 96 values / 16


def _copy_carries_scales(fam) -> bool:
    """Probe the release's pool: does its retraction copy carry a slot's scale row?"""
    from poolfuzz.adapters.sglang.shims import cpu_synchronize

    pool = fam.sg_kv_pool
    pool.k_scale_buffer[0][1] = 7
    with cpu_synchronize(torch.device("cpu")):
        pool.load_cpu_copy(pool.get_cpu_copy(torch.tensor([1])), torch.tensor([2]))
    return bool((pool.k_scale_buffer[0][2] == 7).all())


@pytest.mark.parametrize("name", NAMES)
def test_a_retraction_that_leaves_the_scales_behind_is_caught(api, name):
    """0.5.23's MHATokenToKVPool.get_cpu_copy / load_cpu_copy carry k_buffer and v_buffer only, also when its FP4
    quant method gave it scale buffers: a resumed request's packed K and V sit beside their new slots' old scales.
    A release whose copy carries them passes."""
    carries = _copy_carries_scales(_family(name))  # on a family of its own
    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=CONFIGS[name], family_factory=build_family)
    rid = e.admit(5)
    e.prefill(rid, 5)
    node = e.requests[rid].node
    e.retract(rid)
    if carries:
        e.resume(node)
        e.check()
        return
    with pytest.raises(PoolfuzzFailure) as info:
        e.resume(node)
        e.check()
    assert info.value.divergence.component in ("full.k_scale", "full.v_scale"), info.value


def test_a_pd_transfer_without_the_scales_is_caught(api):
    """0.5.23's PD registration appends BLOCK_SCALE for MHATokenToKVPoolMXFP8 only, and the FP4 pool's main-KV
    descriptors are K and V: the decode node's scale rows stay as they were. A release that sends them passes."""
    _family("dense-fp4")
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.disaggregation.pd import registration

    e = Engine(config=CONFIGS["dense-fp4"], family_factory=build_family)
    rid = e.admit(5)
    e.prefill(rid, 5)
    fam = e.families[e.requests[rid].node]
    args = registration(fam)
    scale_ptrs = {b.data_ptr() for b in fam.sg_kv_pool.k_scale_buffer}
    registered = set(args.kv_data_ptrs) | {p for ptrs in getattr(args, "state_data_ptrs", []) for p in ptrs}
    if scale_ptrs <= registered:
        e.transfer(rid)
        e.check()
        return
    with pytest.raises(PoolfuzzFailure) as info:
        e.transfer(rid)
        e.check()
    assert info.value.divergence.component in ("full.k_scale", "full.v_scale"), info.value
