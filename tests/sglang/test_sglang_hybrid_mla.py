"""Kimi-Linear's pools: SGLang's HybridLinearKVPool with an MLA sub-pool (adapters/sglang/pools/hybrid_mla.py),
built by the installed release and fuzzed through the harness."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS

NAMES = ["mla-ssm", "mla-ssm-ps4"]


def _family(api, config):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_family(config)


@pytest.mark.parametrize("name", NAMES)
def test_the_hybrid_pool_holds_an_mla_sub_pool_read_by_model_layer(api, name):
    """The MLA layers are model layers 2 and 3; the sub-pool's buffers 0 and 1 are what the kernels read."""
    fam = _family(api, CONFIGS[name])
    pool = fam.sg_kv_pool
    assert type(pool).__name__ == "HybridLinearKVPool" and pool.use_mla
    assert isinstance(pool.full_kv_pool, api.MLATokenToKVPool)
    by_layer = {(c.name, c.layer): c.tensor for c in fam.components()}
    for local, layer_id in enumerate(CONFIGS[name].full_layer_ids):
        buf = pool.full_kv_pool.kv_buffer[local]
        assert by_layer[("mla.latent", layer_id)].data_ptr() == buf.data_ptr()
        assert by_layer[("mla.rope", layer_id)].data_ptr() == buf[:, 0, 16:].data_ptr()


def test_the_write_door_files_a_model_layer_under_its_sub_pool_layer(api):
    """A row written through the hybrid pool's door for model layer 3 lands in the sub-pool's layer 1."""
    fam = _family(api, CONFIGS["mla-ssm"])
    row = torch.arange(32, dtype=torch.bfloat16).reshape(1, 32)
    done = fam.kv_pool.write_rows(torch.tensor([5]), {("mla.latent", 3): row[:, :16], ("mla.rope", 3): row[:, 16:]})
    assert done == {("mla.latent", 3), ("mla.rope", 3)}
    subs = fam.sg_kv_pool.full_kv_pool.kv_buffer
    assert torch.equal(subs[1][5, 0], row[0]) and not subs[0][5].any()


@pytest.mark.parametrize("name", NAMES)
def test_fuzz_passes(api, fuzz, name):
    """Retraction, resume, PD transfer and tree-verify moves carry whole latent rows and the recurrent state."""
    _family(api, CONFIGS[name])
    outcome = fuzz(CONFIGS[name], examples=10)
    assert outcome.failure is None, outcome.failure


def test_a_door_that_files_every_layer_under_one_is_caught(api, fuzz, monkeypatch):
    """With ``_transfer_id_context`` mapping every model layer to the sub-pool's first layer, model layer 3's
    rows overwrite model layer 2's: the harness names the lost latent row, it does not pass."""
    _family(api, CONFIGS["mla-ssm"])
    import contextlib

    @contextlib.contextmanager
    def first_layer(self, layer):
        original, layer.layer_id = layer.layer_id, 0
        try:
            yield
        finally:
            layer.layer_id = original

    monkeypatch.setattr(api.HybridLinearKVPool, "_transfer_id_context", first_layer)
    outcome = fuzz(CONFIGS["mla-ssm"], examples=20)
    assert outcome.failure is not None, "a hybrid MLA door that files every layer under one was not caught"
    assert outcome.failure.divergence.component in ("mla.latent", "mla.rope"), outcome.failure


def test_a_dsa_sub_pool_is_read_by_model_layer(api):
    """``dsa-ssm-ps64``: HybridLinearKVPool(use_dsa=True); the index keys are the DSA sub-pool's, by model layer."""
    fam = _family(api, CONFIGS["dsa-ssm-ps64"])
    pool = fam.sg_kv_pool
    assert pool.use_dsa and isinstance(pool.full_kv_pool, api.DSATokenToKVPool)
    index = {c.layer: c.tensor for c in fam.components() if c.name == "dsa.index_k"}
    assert [index[layer].data_ptr() for layer in (2, 3)] == [b.data_ptr() for b in pool.full_kv_pool.index_k_with_scale_buffer]


def test_a_dsa_hybrid_fuzz_passes(api, fuzz):
    _family(api, CONFIGS["dsa-ssm-ps64"])
    outcome = fuzz(CONFIGS["dsa-ssm-ps64"], examples=5)
    assert outcome.failure is None, outcome.failure


def test_a_pd_registration_without_the_index_cache_is_caught(api, fuzz, monkeypatch):
    """The DSA state registered with no buffers (as a hybrid pool that left its sub-pool's index cache out would):
    the decode node's index keys are not the request's."""
    _family(api, CONFIGS["dsa-ssm-ps64"])
    monkeypatch.setattr(api.DSATokenToKVPool, "get_state_buf_infos", lambda self: ([], [], []))
    outcome = fuzz(CONFIGS["dsa-ssm-ps64"], examples=30)
    assert outcome.failure is not None, "a hybrid DSA PD without the index cache was not caught"
    assert outcome.failure.divergence.component == "dsa.index_k", outcome.failure


def test_an_fp8_hybrid_pool_is_checked_as_the_bytes_its_host_copy_and_l3_hold(api, fuzz):
    """An fp8 MLA sub-pool's ``get_kv_buffer`` hands its rows out as float8: read as such, the harness wrote tags
    as fp8 values (1 stored as byte 56) while its host pool and L3 pages are read as the stored bytes, so every page
    the prefill node stored was reported lost ("unrecognised bytes"; a drawn config found it). The device rows are
    the stored bytes too, and the whole machine passes."""
    import dataclasses

    config = dataclasses.replace(CONFIGS["mla-ssm"], name="mla-ssm-fp8", kv_dtype="fp8_e4m3")
    fam = _family(api, config)
    latent = [c.tensor for c in fam.components() if c.name in ("mla.latent", "mla.rope")]
    assert latent and all(t.dtype == torch.uint8 for t in latent)
    outcome = fuzz(config, examples=10)
    assert outcome.failure is None, outcome.failure
