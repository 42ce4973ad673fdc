"""The SGLang adapter reads each mamba layer's state through the request pool's ``mamba2_layer_cache`` (what
the linear-attention kernels update in place), by model layer id: stand-in pools, no SGLang needed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from poolfuzz.adapters.sglang.pools.reads import mamba_layer_states
from poolfuzz.pools.errors import ConfigError


@dataclass(frozen=True)
class _State:
    conv: list
    temporal: torch.Tensor


class _ReqPool:
    """Model layers 3 and 5 hold mamba state at local layers 1 and 0 (a map is not the identity)."""

    def __init__(self, conv, temporal, *, copy=False):
        self.conv, self.temporal, self.copy = conv, temporal, copy
        self.mamba_map = {3: 1, 5: 0}

    def mamba2_layer_cache(self, layer_id):
        local = self.mamba_map[layer_id]
        temporal = self.temporal[local]
        return _State(conv=[c[local] for c in self.conv], temporal=temporal.clone() if self.copy else temporal)


def _buffers():
    conv = [torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)]
    return conv, torch.arange(2 * 4 * 12, dtype=torch.float32).view(2, 4, 12)


def test_each_layer_is_the_state_the_door_routes_its_model_layer_id_to():
    conv, temporal = _buffers()
    states = mamba_layer_states(_ReqPool(conv, temporal), (3, 5), conv, temporal)
    assert states[3][1].data_ptr() == temporal[1].data_ptr() and states[5][1].data_ptr() == temporal[0].data_ptr()
    assert states[3][0][0].data_ptr() == conv[0][1].data_ptr()


def test_without_a_door_the_layers_are_the_buffers_in_order():
    conv, temporal = _buffers()
    states = mamba_layer_states(object(), (3, 5), conv, temporal)
    assert states[3][1].data_ptr() == temporal[0].data_ptr() and states[5][1].data_ptr() == temporal[1].data_ptr()


def test_a_door_that_hands_out_a_copy_is_refused():
    conv, temporal = _buffers()
    with pytest.raises(ConfigError, match=r"mamba2_layer_cache\(3\) hands out a copy"):
        mamba_layer_states(_ReqPool(conv, temporal, copy=True), (3, 5), conv, temporal)
