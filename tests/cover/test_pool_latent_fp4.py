"""FP4 MLA KV (SGLang's MLATokenToKVPoolFP4): the scale row of a slot travels with its packed latent row
(pools/latent_fp4.py), and a copy that leaves it behind is caught."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family


def test_the_scale_row_is_a_component_beside_the_two_packed_parts():
    c = CONFIGS["mla-fp4"]
    comps = [x for x in build_family(c).components() if x.layer == c.full_layer_ids[0]]
    assert [(x.name, x.row_shape) for x in comps] == [("mla.latent", (80,)), ("mla.rope", (16,)), ("mla.scale", (12,))]


@pytest.mark.parametrize("path", ["copy", "move"])
def test_the_scales_travel_with_their_rows(path):
    pool = build_family(CONFIGS["mla-fp4"]).kv_pool
    pool.kv_scale_buffer[1][3] = torch.arange(12, dtype=torch.uint8)
    if path == "copy":
        pool.load_cpu_copy(pool.get_cpu_copy(torch.tensor([3])), torch.tensor([7]))
    else:
        pool.move_kv_cache(torch.tensor([7]), torch.tensor([3]))
    assert torch.equal(pool.kv_scale_buffer[1][7], torch.arange(12, dtype=torch.uint8))


@pytest.mark.parametrize("changes", [dict(attention="mha"), dict(kv_lora_rank=48), dict(qk_rope_head_dim=16)])
def test_impossible_fp4_configs_are_refused(changes):
    with pytest.raises(ConfigError, match="fp4_mx_block16"):
        CONFIGS["mla-fp4"].replace(**changes)
