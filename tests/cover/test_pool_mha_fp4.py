"""FP4 MHA KV (config ``dense-fp4``, pools/mha_fp4.py): packed K and V with a scale row each, four components; the
scales travel with their rows, and a copy that leaves them behind is caught."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family


def test_packed_rows_and_scale_rows_are_four_components():
    c = CONFIGS["dense-fp4"]
    comps = [x for x in build_family(c).components() if x.layer == 1]
    assert [(x.name, x.row_shape) for x in comps] == [("full.k", (2, 48)), ("full.v", (2, 48)),
                                                     ("full.k_scale", (12,)), ("full.v_scale", (12,))]
    assert all(x.tensor.dtype == torch.uint8 for x in comps)


@pytest.mark.parametrize("path", ["copy", "move", "transfer"])
def test_the_scales_travel_with_their_rows(path):
    family = build_family(CONFIGS["dense-fp4"])
    pool = family.kv_pool
    pool.v_scale_buffer[1][3] = torch.arange(12, dtype=torch.uint8)
    if path == "copy":
        pool.load_cpu_copy(pool.get_cpu_copy(torch.tensor([3])), torch.tensor([7]))
    elif path == "move":
        pool.move_kv_cache(torch.tensor([7]), torch.tensor([3]))
    else:  # PD: the scales are the BLOCK_SCALE state, rows of the same slots
        assert family.transfer.state_components(family) == [("BLOCK_SCALE", "kv_pool")]
        for buf in pool.get_state_buf_infos("BLOCK_SCALE"):
            buf[7] = buf[3]
    assert torch.equal(pool.v_scale_buffer[1][7], torch.arange(12, dtype=torch.uint8))


@pytest.mark.parametrize("changes", [dict(head_dim=8), dict(head_dim=95), dict(swa_layers=1, sliding_window=4,
                                                                               swa_tokens=16)])
def test_impossible_fp4_mha_configs_are_refused(changes):
    with pytest.raises(ConfigError, match="fp4_mx_block16"):
        CONFIGS["dense-fp4"].replace(**changes)
