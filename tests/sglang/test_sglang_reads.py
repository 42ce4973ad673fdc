"""The harness checksums what the attention kernels read: each layer's K and V as the model's KV pool hands
them out (``get_key_buffer`` / ``get_value_buffer`` by model layer id), see adapters/sglang/pools/reads.py."""

from __future__ import annotations

import pytest


from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError


def _config(api, name):
    from poolfuzz.adapters.sglang import unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return CONFIGS[name]


def _engine(config):
    from poolfuzz.adapters.sglang import build_family

    return Engine(config=config, family_factory=build_family)


@pytest.mark.parametrize("name", ["dense", "swa", "hybrid-linear", "mla"])
def test_every_layer_is_read_through_the_pool_the_kernels_hold(api, monkeypatch, name):
    config = _config(api, name)
    from poolfuzz.adapters.sglang.api import load

    asked = []
    pool_cls = {"swa": load().SWAKVPool, "hybrid-linear": load().HybridLinearKVPool,
                "mla": load().MLATokenToKVPool}.get(name, load().MHATokenToKVPool)
    real = pool_cls.get_key_buffer
    monkeypatch.setattr(pool_cls, "get_key_buffer", lambda self, layer_id, *a: (asked.append(layer_id),
                                                                                 real(self, layer_id, *a))[1])
    e = _engine(config)
    attention = sorted(config.full_layer_ids + config.swa_layer_ids)
    assert sorted(set(asked)) == attention  # by model layer id, every attention layer (both nodes)
    rid = e.admit(7)
    e.prefill(rid, 7)
    e.decode([rid])
    e.check()


def test_a_read_door_that_routes_a_layer_elsewhere_is_caught(api, monkeypatch):
    """SWAKVPool hands out the full layer's V for the SWA layer's V: the rows the write door filed are not
    what the kernels read, and the checksums say whose data they read instead."""
    config = _config(api, "swa")
    from poolfuzz.adapters.sglang.api import load

    cls = load().SWAKVPool
    real = cls.get_value_buffer
    full_id, swa_id = config.full_layer_ids[0], config.swa_layer_ids[0]
    monkeypatch.setattr(cls, "get_value_buffer",
                        lambda self, layer_id: real(self, full_id if layer_id == swa_id else layer_id))
    try:
        e = _engine(config)
    except ConfigError as exc:  # the two sub-pools' buffers differ in size here: handed out all the same
        pytest.fail(f"the misrouted door was refused at build instead of caught by the checks: {exc}")
    with pytest.raises(PoolfuzzFailure) as info:
        rid = e.admit(7)
        e.prefill(rid, 7)
        e.check()
    assert info.value.divergence.component == "swa.v", info.value


def test_a_read_door_that_hands_out_a_copy_is_refused(api, monkeypatch):
    config = _config(api, "dense")
    from poolfuzz.adapters.sglang.api import load

    cls = load().MHATokenToKVPool
    real = cls.get_value_buffer
    monkeypatch.setattr(cls, "get_value_buffer", lambda self, layer_id: real(self, layer_id).clone())
    with pytest.raises(ConfigError, match="hands out a copy"):
        _engine(config)



@pytest.mark.parametrize("name", ["hybrid-linear", "hybrid-spec"])
def test_every_mamba_layer_is_read_through_the_request_pool_the_kernels_hold(api, monkeypatch, name):
    """The linear-attention kernels get a layer's conv and temporal state from ``mamba2_layer_cache(layer_id)``
    by model layer id; the harness checksums those tensors."""
    config = _config(api, name)
    from poolfuzz.adapters.sglang.api import load

    cls = load().HybridReqToTokenPool
    if not hasattr(cls, "mamba2_layer_cache"):
        pytest.skip(f"sglang {api.version}'s request pool has no mamba2_layer_cache door")
    asked = []
    real = cls.mamba2_layer_cache
    monkeypatch.setattr(cls, "mamba2_layer_cache", lambda self, layer_id: (asked.append(layer_id),
                                                                           real(self, layer_id))[1])
    e = _engine(config)
    assert sorted(set(asked)) == sorted(config.mamba_layer_ids)
    rid = e.admit(7)
    e.prefill(rid, 7)
    e.decode([rid])
    e.check()


def test_a_mamba_map_that_sends_two_layers_to_one_state_is_caught(api, monkeypatch):
    """Every mamba layer's kernels get local layer 0's state: the second layer's updates overwrite the first's,
    and the checksums say which layer's state the slot holds instead."""
    config = _config(api, "hybrid-linear")
    from poolfuzz.adapters.sglang.api import load

    cls = load().HybridReqToTokenPool
    if not hasattr(cls, "mamba2_layer_index"):
        pytest.skip(f"sglang {api.version}'s request pool has no mamba2_layer_index")
    real = cls.mamba2_layer_index
    monkeypatch.setattr(cls, "mamba2_layer_index", lambda self, layer_id: (real(self, layer_id), 0)[1])
    e = _engine(config)
    with pytest.raises(PoolfuzzFailure) as info:
        rid = e.admit(7)
        e.prefill(rid, 7)
        e.check()
    assert info.value.divergence.component.startswith("mamba."), info.value


def test_a_mamba_door_that_hands_out_a_copy_is_refused(api, monkeypatch):
    config = _config(api, "hybrid-linear")
    from poolfuzz.adapters.sglang.api import load

    cls = load().MambaPool
    if not hasattr(cls, "mamba2_layer_cache"):
        pytest.skip(f"sglang {api.version}'s MambaPool has no mamba2_layer_cache door")
    real = cls.mamba2_layer_cache

    def copied(self, layer):
        state = real(self, layer)
        return type(state)(**{**{f: getattr(state, f) for f in state.__dataclass_fields__},
                              "temporal": state.temporal.clone()})

    monkeypatch.setattr(cls, "mamba2_layer_cache", copied)
    with pytest.raises(ConfigError, match="hands out a copy"):
        _engine(config)
