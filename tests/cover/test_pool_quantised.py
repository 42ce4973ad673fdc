"""A KV pool built with a quant method (SGLang's CPU fp8 KV cache): the forward's K and V go through its
quantising write door, and a quantiser that drops a token is caught (pools/quantised.py)."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure, signature_of
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family
from poolfuzz.pools.quantised import MHATokenToKVPoolQuantised, as_model_rows, quantise


def test_every_fp8_byte_round_trips_through_the_model_dtype():
    """The door hands the quantiser float16 (bfloat16 would turn the NaN byte 0x7f into 0xff)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(quantise(as_model_rows(every)), every)


@pytest.mark.parametrize("name", ["dense-cpu-fp8", "dense-cpu-fp8-ps4"])
def test_the_config_builds_the_quantised_pool_and_writes_through_its_door(name, monkeypatch):
    calls = []
    real = MHATokenToKVPoolQuantised.quantize_and_store
    monkeypatch.setattr(MHATokenToKVPoolQuantised, "quantize_and_store",
                        lambda self, local, loc, k, v: (calls.append((local, loc.numel(), k.dtype)),
                                                        real(self, local, loc, k, v))[1])
    e = Engine(config=CONFIGS[name])
    assert type(build_family(CONFIGS[name]).kv_pool) is MHATokenToKVPoolQuantised
    rid = e.admit(6)
    e.prefill(rid, 6)
    e.decode([rid])
    e.check()
    assert (0, 6, torch.float16) in calls and (1, 1, torch.float16) in calls


def test_a_quantiser_that_skips_the_last_token_is_caught():
    e = Engine(config=CONFIGS["dense-cpu-fp8"], faults=("quant-store-skips-last-token",))
    with pytest.raises(PoolfuzzFailure) as info:
        rid = e.admit(5)
        e.prefill(rid, 5)
        e.check()
    assert info.value.divergence.position == 4
    assert signature_of(info.value) == "StateLost:contents:full@prefill"


@pytest.mark.parametrize("changes", [dict(kv_dtype="bfloat16"), dict(kv_quant="nvfp4"),
                                     dict(attention="mla"), dict(kv_scale_block=8, head_dim=48)])
def test_impossible_quantised_configs_are_refused(changes):
    with pytest.raises(ConfigError, match="kv_quant"):
        CONFIGS["dense-cpu-fp8"].replace(**changes)
