"""The CPU stand-in for SGLang's ``direct`` host transfer op keeps the op's contract (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.adapters.sglang.host_tier.host import cpu_transfer_kv_direct


def test_each_layer_row_goes_to_its_destination_row():
    src = [torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 100 * layer for layer in range(2)]
    dst = [torch.zeros(6, 3) for _ in range(2)]
    cpu_transfer_kv_direct(src, dst, torch.tensor([5, 2, 7]), torch.tensor([0, 4, 1]), 1)
    for layer in range(2):
        assert torch.equal(dst[layer][0], src[layer][5])
        assert torch.equal(dst[layer][4], src[layer][2])
        assert torch.equal(dst[layer][1], src[layer][7])
        assert not dst[layer][[2, 3, 5]].any()  # rows not named are untouched


def test_mismatched_lengths_and_layer_counts_are_refused():
    src, dst = [torch.zeros(4, 2)], [torch.zeros(4, 2)]
    with pytest.raises(ValueError, match="source rows"):
        cpu_transfer_kv_direct(src, dst, torch.tensor([0, 1]), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="same number of layers"):
        cpu_transfer_kv_direct(src, dst + dst, torch.tensor([0]), torch.tensor([0]), 1)


# --- the page-first copies (host buffers ``[pages, layers, page_size, ...]``) ---------------------
def _device_layers(n_layers: int, tokens: int, base: int) -> list[torch.Tensor]:
    return [torch.arange(tokens * 2, dtype=torch.float32).reshape(tokens, 2) + base + 1000 * layer
            for layer in range(n_layers)]


def test_a_page_first_write_back_then_load_back_gives_the_rows_back_layer_by_layer():
    from poolfuzz.adapters.sglang.host_tier.host import (
        cpu_transfer_kv_all_layer_direct_lf_pf, cpu_transfer_kv_per_layer_direct_pf_lf,
    )

    ps, layers = 4, 3
    k, v = _device_layers(layers, 16, 0), _device_layers(layers, 16, 500)
    host_k, host_v = torch.zeros(5, layers, ps, 2), torch.zeros(5, layers, ps, 2)
    dev_idx, host_idx = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7]), torch.tensor([12, 13, 14, 15, 0, 1, 2, 3])
    cpu_transfer_kv_all_layer_direct_lf_pf(k + v, [host_k, host_v], dev_idx, host_idx, ps)
    assert torch.equal(host_k[3, 1], k[1][8:12]) and torch.equal(host_v[0, 2], v[2][4:8])
    assert not host_k[[1, 2, 4]].any()  # pages not named are untouched
    back_k, back_v = [torch.zeros(16, 2) for _ in range(layers)], [torch.zeros(16, 2) for _ in range(layers)]
    new_idx = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    for layer in range(layers):  # the load-back goes one layer at a time, as the controller drives it
        cpu_transfer_kv_per_layer_direct_pf_lf([host_k, host_v], [back_k[layer], back_v[layer]], host_idx, new_idx,
                                            layer, ps)
        assert torch.equal(back_k[layer][0:4], k[layer][8:12]) and torch.equal(back_v[layer][12:16], v[layer][4:8])
        assert not back_k[layer][4:12].any()


def test_a_single_buffer_pool_is_copied_as_one_component():
    """MLA and mamba host pools pass one buffer, not K and V."""
    from poolfuzz.adapters.sglang.host_tier.host import (
        cpu_transfer_kv_all_layer_direct_lf_pf, cpu_transfer_kv_per_layer_direct_pf_lf,
    )

    latent = _device_layers(2, 6, 7)
    host = torch.zeros(6, 2, 1, 2)
    cpu_transfer_kv_all_layer_direct_lf_pf(latent, [host], torch.tensor([5, 1]), torch.tensor([0, 3]), 1)
    back = torch.zeros(6, 2)
    cpu_transfer_kv_per_layer_direct_pf_lf([host], [back], torch.tensor([3]), torch.tensor([2]), 1, 1)
    assert torch.equal(back[2], latent[1][1]) and not back[[0, 1, 3, 4, 5]].any()


def test_page_first_copies_refuse_mismatched_lengths():
    from poolfuzz.adapters.sglang.host_tier.host import (
        cpu_transfer_kv_all_layer_direct_lf_pf, cpu_transfer_kv_per_layer_direct_pf_lf,
    )

    with pytest.raises(ValueError, match="source rows"):
        cpu_transfer_kv_all_layer_direct_lf_pf([torch.zeros(4, 2)], [torch.zeros(4, 1, 1, 2)], torch.tensor([0, 1]),
                                            torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="source rows"):
        cpu_transfer_kv_per_layer_direct_pf_lf([torch.zeros(4, 1, 1, 2)], [torch.zeros(4, 2)], torch.tensor([0]),
                                            torch.tensor([0, 1]), 0, 1)
