"""MLA, DSA and block-scaled KV pools: each buffer is its own component, addressed as the pool lays it out."""

import pytest
import torch

from poolfuzz.harness.checksums import SlotReader, row_checksums
from poolfuzz.harness.failures import signature_from
from poolfuzz.pools import CONFIGS, ConfigError, build_family
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig

COMPONENTS = {
    "mla": {"mla.latent", "mla.rope"},
    "dsa": {"mla.latent", "mla.rope", "dsa.index_k", "dsa.index_scale"},
    "fp8-scaled": {"full.k", "full.v", "full.k_scale", "full.v_scale"},
}


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.split("-ps")[0] in COMPONENTS])
def test_every_buffer_is_a_component_with_distinct_storage(name):
    """Each buffer is named, and no two components of a layer overlap a byte."""
    family = build_family(CONFIGS[name], device="cpu")
    comps = family.components()
    assert {c.name for c in comps} == COMPONENTS[name.split("-ps")[0]]
    for layer in CONFIGS[name].full_layer_ids:
        mine = [c for c in comps if c.layer == layer]
        for c in mine:
            c.tensor.zero_()
        for i, c in enumerate(mine):
            c.tensor[c.at(torch.arange(c.num_slots))] = i + 1
        for i, c in enumerate(mine):
            assert bool((c.tensor == i + 1).all()), f"{c} was overwritten by another component"


def test_dsa_index_cache_is_page_major():
    """A DSA page holds all its tokens' keys, then all their scales (SGLang's IndexKeyCache)."""
    family = build_family(CONFIGS["dsa-ps4"], device="cpu")
    pool = family.kv_pool
    keys, scales = [c for c in family.components() if c.layer == 0 and c.name.startswith("dsa.")]
    keys.tensor[keys.at(torch.tensor([9]))] = 7  # slot 9: page 2, offset 1
    scales.tensor[scales.at(torch.tensor([9]))] = 5
    page = pool.index_k_with_scale_buffer[0][2]
    d, s = pool.index_head_dim, pool.index_scale_bytes
    assert bool((page[d:2 * d] == 7).all()) and int(page.count_nonzero()) == d + s
    assert bool((page[4 * d + s:4 * d + 2 * s] == 5).all())


def test_a_page_major_reader_checksums_the_slot_rows():
    buf = torch.arange(3 * 4 * 16, dtype=torch.int64).reshape(3, 4 * 16).to(torch.uint8)
    keys = Component(name="dsa.index_k", layer=0, space="full", tensor=buf[:, :32].view(-1, 4, 8), page_size=4)
    slots = torch.tensor([0, 5, 11])
    got = SlotReader(keys.tensor, page_size=4)(slots)
    assert torch.equal(got, row_checksums(torch.stack([keys.tensor[int(s) // 4, int(s) % 4] for s in slots])))


def test_a_translated_component_is_addressed_where_the_engines_table_puts_each_slot():
    """A unified memory pool hands out virtual ids and moves their rows (compaction): a component with the engine's
    table reads and writes each slot's row where the table points now, for a tensor of ids and for one id."""
    table = torch.tensor([0, 7, 3, 5, 1, 2, 4, 6])  # virtual id -> physical row, as the engine binds it
    rows = torch.zeros(8, 2, dtype=torch.int64)
    comp = Component(name="full.k", layer=0, space="full", tensor=rows, translate=lambda ids: table[ids])
    comp.tensor[comp.at(torch.tensor([1, 3]))] = torch.tensor([[11, 11], [33, 33]])
    assert rows[7].tolist() == [11, 11] and rows[5].tolist() == [33, 33] and rows[1].tolist() == [0, 0]
    assert comp.tensor[comp.at(3)].tolist() == [33, 33]
    table[3] = 6  # compaction moved virtual id 3's row, and the engine rebound it
    rows[6] = rows[5]
    rows[5] = 0
    assert comp.tensor[comp.at(torch.tensor([3]))].tolist() == [[33, 33]]


def test_impossible_storage_configs_are_refused():
    base = dict(name="x", architecture="llama", full_tokens=48, max_context=48)
    with pytest.raises(ConfigError, match="attention 'mla' is built for full-attention-only models"):
        ModelConfig(**base, attention="mla", swa_layers=1, sliding_window=4, swa_tokens=16)
    with pytest.raises(ConfigError, match="kv_scale_block needs"):
        ModelConfig(**base, kv_scale_block=4)
    with pytest.raises(ConfigError, match="index_head_dim"):
        ModelConfig(**base, attention="dsa", index_head_dim=20)
    with pytest.raises(ConfigError, match="attention 'gqa' is not one of"):
        ModelConfig(**base, attention="gqa")


def test_a_buffer_sharing_its_space_is_its_own_bug():
    """Losing the rope part and losing the index keys are two bugs; K and V of a space are one."""
    def sig(component):
        return signature_from("StateLost", {"component": component, "space": "full", "check": "contents",
                                            "action": "resume"})
    assert sig("mla.rope") == "StateLost:contents:mla.rope@resume"
    assert sig("dsa.index_k") != sig("mla.rope")
    assert sig("full.k_scale") == "StateLost:contents:full.k_scale@resume"
    assert sig("full.k") == sig("full.v") == "StateLost:contents:full@resume"
