"""The CPU stand-in for SGLang's ``direct`` host transfer op keeps the op's contract (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.adapters.sglang.host import _transfer_kv_direct


def test_each_layer_row_goes_to_its_destination_row():
    src = [torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 100 * layer for layer in range(2)]
    dst = [torch.zeros(6, 3) for _ in range(2)]
    _transfer_kv_direct(src, dst, torch.tensor([5, 2, 7]), torch.tensor([0, 4, 1]), 1)
    for layer in range(2):
        assert torch.equal(dst[layer][0], src[layer][5])
        assert torch.equal(dst[layer][4], src[layer][2])
        assert torch.equal(dst[layer][1], src[layer][7])
        assert not dst[layer][[2, 3, 5]].any()  # rows not named are untouched


def test_mismatched_lengths_and_layer_counts_are_refused():
    src, dst = [torch.zeros(4, 2)], [torch.zeros(4, 2)]
    with pytest.raises(ValueError, match="source rows"):
        _transfer_kv_direct(src, dst, torch.tensor([0, 1]), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="same number of layers"):
        _transfer_kv_direct(src, dst + dst, torch.tensor([0]), torch.tensor([0]), 1)
