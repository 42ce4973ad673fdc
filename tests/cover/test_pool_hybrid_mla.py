"""Kimi-Linear's shape (config ``mla-ssm``): a hybrid-linear pool whose full-attention sub-pool is MLA, its model
layers mapped to the sub-pool's, and the catalogue fault that registers it for PD as if it were MHA."""

import pytest
import torch

from poolfuzz.pools import CONFIGS, ConfigError, build_family
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.latent import MLATokenToKVPool


@pytest.mark.parametrize("name", ["mla-ssm", "mla-ssm-ps4"])
def test_the_full_layers_are_latent_rows_beside_the_recurrent_state(name):
    c = CONFIGS[name]
    family = build_family(c)
    assert isinstance(family.kv_pool.full_kv_pool, MLATokenToKVPool) and family.kv_pool.cpu_copy_carries_mamba
    comps = family.components()
    assert {(x.name, x.layer) for x in comps if x.space == "full"} == {
        (part, layer) for part in ("mla.latent", "mla.rope") for layer in (2, 3)}
    assert {x.layer for x in comps if x.name.startswith("mamba.")} == {0, 1}
    assert family.backup_mode == "cpu_tensor"  # recurrent state: no host pool carries it


def test_a_retraction_carries_the_latent_rows_and_the_state():
    family = build_family(CONFIGS["mla-ssm"])
    pool = family.kv_pool
    pool.full_kv_pool.kv_buffer[1][3] = torch.arange(32, dtype=torch.bfloat16)
    slot = family.req_pool.mamba_allocator.alloc(1)
    pool.mamba_pool.temporal[:, int(slot[0])] = 7
    cpu = pool.get_cpu_copy(torch.tensor([3]), mamba_indices=slot)
    other = family.req_pool.mamba_allocator.alloc(1)
    pool.load_cpu_copy(cpu, torch.tensor([9]), mamba_indices=other)
    assert torch.equal(pool.full_kv_pool.kv_buffer[1][9, 0], torch.arange(32, dtype=torch.bfloat16))
    assert bool((pool.mamba_pool.temporal[:, int(other[0])] == 7).all())


def test_only_unquantised_latent_attention_may_sit_beside_mamba_layers():
    base = dict(name="x", architecture="kimi-linear", full_tokens=48, max_context=48, mamba_layers=1, mamba_slots=2)
    ModelConfig(**base, attention="mla")
    ModelConfig(**base, attention="dsa")
    with pytest.raises(ConfigError, match="unquantised also beside mamba layers"):
        ModelConfig(**base, attention="mla", kv_quant="fp4_mx_block16", kv_lora_rank=160, qk_rope_head_dim=32)


def test_a_dsa_sub_pool_sends_its_index_cache_after_the_recurrent_state():
    """``dsa-ssm-ps64``: the hybrid pool's PD state is MAMBA, then the DSA sub-pool's index pages (SGLang's order)."""
    family = build_family(CONFIGS["dsa-ssm-ps64"])
    assert family.transfer.state_components(family) == [("MAMBA", "kv_pool"), ("DSA", "kv_pool")]
    assert family.kv_pool.get_state_buf_infos("DSA") == family.kv_pool.full_kv_pool.index_k_with_scale_buffer
