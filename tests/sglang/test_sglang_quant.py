"""SGLang's CPU fp8 KV cache (``dense-cpu-fp8``): an MHA pool built with the ``cpu_fp8_e4m3`` KV quant method,
whose ``set_kv_buffer`` quantises the model's K and V into the fp8 buffers (adapters/sglang/pools/storage.py)."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _config(name):
    from poolfuzz.adapters.sglang import unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(why)
    return CONFIGS[name]


def _method_cls():
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod

    return CPUFP8KVCacheMethod


@pytest.mark.parametrize("name", ["dense-cpu-fp8", "dense-cpu-fp8-ps4"])
def test_every_forward_is_quantised_by_sglangs_method(api, monkeypatch, name):
    config = _config(name)
    from poolfuzz.adapters.sglang import build_family

    cls = _method_cls()
    stored = []
    real = cls.quantize_and_store
    monkeypatch.setattr(cls, "quantize_and_store", lambda self, *a, **k: (stored.append(a[4].numel()),
                                                                         real(self, *a, **k))[1])
    e = Engine(config=config, family_factory=build_family)
    fam = e.families[next(iter(e.families))]
    assert fam.sg_kv_pool.is_quantized_kv_cache and fam.sg_kv_pool.quant_method.name == "cpu_fp8_e4m3"
    rid = e.admit(7)
    e.prefill(rid, 7)
    e.decode([rid])
    e.check()
    assert stored.count(7) == config.full_layers and stored.count(1) == config.full_layers  # per layer: prefill, decode


def test_a_quantiser_that_skips_the_last_token_is_caught(api, monkeypatch):
    """SGLang's method stores every slot but the batch's last: the last token's K and V never land."""
    config = _config("dense-cpu-fp8")
    from poolfuzz.adapters.sglang import build_family

    cls = _method_cls()
    real = cls.quantize_and_store
    monkeypatch.setattr(cls, "quantize_and_store",
                        lambda self, kb, vb, ks, vs, loc, k, v, *a, **kw: real(self, kb, vb, ks, vs, loc[:-1], k[:-1],
                                                                               v[:-1], *a, **kw))
    e = Engine(config=config, family_factory=build_family)
    with pytest.raises(PoolfuzzFailure) as info:
        rid = e.admit(5)
        e.prefill(rid, 5)
        e.check()
    d = info.value.divergence
    assert d.component in ("full.k", "full.v") and d.position == 4, info.value


def _fp4_pool_carries_scales() -> bool:
    """Probe the release's FP4 MLA pool: does its retraction copy carry a slot's scale row?"""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    from poolfuzz.adapters.sglang.api import construct
    from poolfuzz.adapters.sglang.shims import cpu_synchronize

    pool = construct(MLATokenToKVPoolFP4, size=8, page_size=1, dtype=torch.float4_e2m1fn_x2, kv_lora_rank=160,
                     qk_rope_head_dim=32, layer_num=1, device="cpu", enable_memory_saver=False)
    pool.kv_scale_buffer[0][1] = 7
    with cpu_synchronize(torch.device("cpu")):
        pool.load_cpu_copy(pool.get_cpu_copy(torch.tensor([1])), torch.tensor([2]))
    return bool((pool.kv_scale_buffer[0][2] == 7).all())


def test_an_fp4_mla_retraction_that_leaves_the_scales_behind_is_caught(api):
    """SGLang's MLATokenToKVPoolFP4 (0.5.23) inherits MLATokenToKVPool's get_cpu_copy / load_cpu_copy, which
    carry kv_buffer only: a resumed request's packed rows land in new slots beside those slots' old scale rows.
    A release whose copy carries them passes."""
    config = _config("mla-fp4")
    from poolfuzz.adapters.sglang import build_family

    e = Engine(config=config, family_factory=build_family)
    rid = e.admit(5)
    e.prefill(rid, 5)
    node = e.requests[rid].node
    e.retract(rid)
    if _fp4_pool_carries_scales():
        e.resume(node)
        e.check()
        return
    with pytest.raises(PoolfuzzFailure) as info:
        e.resume(node)
        e.check()
    assert info.value.divergence.component == "mla.scale", info.value
