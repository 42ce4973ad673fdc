"""One registry from an attention kind to its rules and its pools (``pools/attention_kinds.py``), read by the builtin
family's blueprint and builder, and mirrored once by the SGLang adapter (``adapters/sglang/pools/storage.STORAGE``)."""

from __future__ import annotations

import pytest

from poolfuzz.adapters.sglang.pools.storage import STORAGE
from poolfuzz.pools.attention_kinds import KINDS, kind_of
from poolfuzz.pools.blueprint import Blueprint
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family
from poolfuzz.pools.latent import DSATokenToKVPool, MLATokenToKVPool

# A named config of each kind, full attention only.
ALONE = {"mha": "dense", "mla": "mla", "dsa": "dsa", "msa": "minimax-sparse"}


def test_every_attention_kind_is_known_to_the_sglang_adapter():
    """A new kind is one entry in KINDS and one in the adapter's STORAGE: forgetting the second fails here."""
    assert set(STORAGE) == set(KINDS) == set(ALONE)


def test_a_kind_the_registry_does_not_know_is_refused_with_the_kinds_it_knows():
    with pytest.raises(ConfigError, match="attention 'gqa' is not one of mha, mla, dsa, msa"):
        CONFIGS["dense"].replace(attention="gqa")


@pytest.mark.parametrize("kind", sorted(ALONE))
def test_a_full_attention_model_is_built_with_its_kinds_pool(kind):
    config = CONFIGS[ALONE[kind]]
    assert kind_of(config).name == kind
    family = build_family(config)
    assert type(family.kv_pool) is Blueprint().kv_pool_class(config)
    assert {c.name.split(".")[0] for c in family.kv_pool.components()} >= {
        "mha": {"full"}, "mla": {"mla"}, "dsa": {"mla", "dsa"}, "msa": {"full", "msa"}}[kind]


def test_one_blueprint_field_decides_a_kinds_pool_alone_and_beside_recurrent_layers():
    """The registry names the blueprint field; a fault replacing it reaches both builds of that kind."""

    class Planted(MLATokenToKVPool):
        pass

    blueprint = Blueprint(mla_kv_pool=Planted)
    assert blueprint.kv_pool_class(CONFIGS["mla"]) is Planted
    assert blueprint.hybrid_full_pool(CONFIGS["mla-ssm"]) is Planted
    assert blueprint.hybrid_full_pool(CONFIGS["dsa-ssm-ps64"]) is DSATokenToKVPool
    assert type(build_family(CONFIGS["dsa-ssm-ps64"]).kv_pool.full_kv_pool) is DSATokenToKVPool


def test_the_kinds_own_rules_run_on_every_config():
    with pytest.raises(ConfigError, match="index_head_dim \\(40\\) must be a multiple of 16"):
        CONFIGS["dsa"].replace(index_head_dim=40)
    with pytest.raises(ConfigError, match="msa_layers is set but attention is 'mha'"):
        CONFIGS["dense"].replace(msa_layers="V")
    with pytest.raises(ConfigError, match="kv_lora_rank \\(8\\) and qk_rope_head_dim"):
        CONFIGS["mla-ssm"].replace(kv_lora_rank=8)
    # a rope part too narrow for a tag is refused; none at all (NoPE, GLM-5 Next's DSA layers) is a row of its own
    with pytest.raises(ConfigError, match="or qk_rope_head_dim 0 for rows without a rope part"):
        CONFIGS["mla"].replace(qk_rope_head_dim=8)
    nope = build_family(CONFIGS["mla"].replace(qk_rope_head_dim=0))
    assert {c.name for c in nope.components()} == {"mla.latent"}
    # which kinds take a KV quant method is the kinds' answer, named in the message
    with pytest.raises(ConfigError, match="kv_quant 'fp4_mx_block16' needs attention 'mha' or 'mla'"):
        CONFIGS["dsa"].replace(kv_quant="fp4_mx_block16")
    with pytest.raises(ConfigError, match="kv_quant 'fp4_mx_block16' on MLA needs kv_lora_rank"):
        CONFIGS["mla-fp4"].replace(kv_lora_rank=48)
