"""MiniMax sparse attention (SGLang's MiniMaxSparseKVPool, pools/minimax_sparse.py): main K/V of every layer, an
index key beside every sparse layer and an index value beside the K+V group's, each its own component, carried by
every path that moves a row; a copy that skips the K-only group is caught."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family


def test_every_buffer_is_a_component_of_its_layer():
    c = CONFIGS["minimax-sparse"]  # layers D V K V
    names = {(x.name, x.layer) for x in build_family(c).components()}
    assert names == ({("full.k", i) for i in range(4)} | {("full.v", i) for i in range(4)}
                     | {("msa.index_k", 1), ("msa.index_k", 2), ("msa.index_k", 3)}
                     | {("msa.index_v", 1), ("msa.index_v", 3)})
    index = [x for x in build_family(c).components() if x.name.startswith("msa.")]
    assert {x.row_shape for x in index} == {(1, c.index_head_dim)}


@pytest.mark.parametrize("path", ["copy", "move", "transfer"])
def test_every_index_row_travels_with_its_slot(path):
    c = CONFIGS["minimax-sparse"]
    fam = build_family(c)
    pool = fam.kv_pool
    comps = [x for x in pool.components() if x.name.startswith("msa.")]
    for n, comp in enumerate(comps):
        comp.tensor[3] = n + 1
    if path == "copy":
        pool.load_cpu_copy(pool.get_cpu_copy(torch.tensor([3])), torch.tensor([7]))
    elif path == "move":
        pool.move_kv_cache(torch.tensor([7]), torch.tensor([3]))
    else:  # PD: the index caches cross as one state type, an item a page of rows
        bufs = pool.get_state_buf_infos("MINIMAX_INDEX")
        assert sorted(b.data_ptr() for b in bufs) == sorted(x.tensor.data_ptr() for x in comps)
        for b in bufs:
            b[7] = b[3]
    for n, comp in enumerate(comps):
        assert bool((comp.tensor[7] == n + 1).all()), comp


@pytest.mark.parametrize("changes, words", [
    (dict(msa_layers="DVK"), "one letter per full-attention layer"),
    (dict(msa_layers="DDDD"), "at least one sparse"),
    (dict(msa_layers="DVXK"), "one letter per full-attention layer"),
    (dict(index_head_dim=8), "index_head_dim"),
    (dict(attention="mha"), "set attention = 'msa'"),
])
def test_impossible_minimax_configs_are_refused(changes, words):
    with pytest.raises(ConfigError, match=words):
        CONFIGS["minimax-sparse"].replace(**changes)
