"""SGLang's MLA, DSA and MXFP8 KV pools, built by the installed release and fuzzed through the harness."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS, ModelConfig
from poolfuzz.pools.errors import ConfigError

# SGLang's DSA indexer asserts 128-value index keys on 64-token pages; MXFP8 scales blocks of 32.
DSA_PS64 = CONFIGS["dsa-ps64"]
MXFP8 = ModelConfig(name="mxfp8", architecture="llama", full_layers=2, full_tokens=48, request_rows=5,
                    max_context=48, kv_dtype="fp8_e4m3", head_num=2, head_dim=192, kv_scale_block=32)
LATENT = {"mla": CONFIGS["mla"], "mla-ps4": CONFIGS["mla-ps4"], "dsa-ps64": DSA_PS64}


def _family(api, config):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_family(config)


def _page_aware_move_or_skip(api, name):
    """A release whose DSA tree-verify move is page-unaware fails a fuzz there first (a real defect,
    tests/sglang/test_sglang_tree_drafts.py::test_a_page_unaware_dsa_move_is_caught)."""
    from tests.sglang.families import dsa_move_is_page_aware

    if name == "dsa-ps64" and not dsa_move_is_page_aware(api):
        pytest.skip(f"sglang {api.version}: its DSA index move is page-unaware, which a tree verify meets first")


class TestLatentPools:
    @pytest.mark.parametrize("name", list(LATENT))
    def test_components_are_the_release_s_buffers(self, api, name):
        """The latent and rope parts (and DSA's index keys, page-major) are views of SGLang's tensors."""
        fam = _family(api, LATENT[name])
        pool = fam.sg_kv_pool
        storages = {t.untyped_storage().data_ptr() for t in pool.kv_buffer}
        storages |= {t.untyped_storage().data_ptr() for t in getattr(pool, "index_k_with_scale_buffer", [])}
        names = {c.name for c in fam.components()}
        assert {"mla.latent", "mla.rope"} <= names
        assert ("dsa.index_k" in names) == (name == "dsa-ps64")
        for comp in fam.components():
            assert comp.tensor.untyped_storage().data_ptr() in storages, comp

    @pytest.mark.parametrize("name", list(LATENT))
    def test_fuzz_passes(self, api, fuzz, name):
        """MLA's copy carries whole latent rows and DSA's its index pages: nothing is lost."""
        _family(api, LATENT[name])
        _page_aware_move_or_skip(api, name)
        outcome = fuzz(LATENT[name], examples=10)
        assert outcome.failure is None, outcome.failure

    def test_a_dsa_copy_without_the_index_cache_is_caught(self, api, fuzz, monkeypatch):
        """The harness checks what SGLang's DSA copy carries: with ``index_k`` left out of it (the
        MLA copy alone), a resumed request's index keys are another request's."""
        _family(api, DSA_PS64)
        _page_aware_move_or_skip(api, "dsa-ps64")
        mla = api.MLATokenToKVPool
        monkeypatch.setattr(api.DSATokenToKVPool, "get_cpu_copy",
                            lambda self, indices, mamba_indices=None, req_pool_index=None:
                            {"kv": mla.get_cpu_copy(self, indices), "index_k": None})
        monkeypatch.setattr(api.DSATokenToKVPool, "load_cpu_copy",
                            lambda self, cpu, indices, mamba_indices=None, req_pool_index=None:
                            mla.load_cpu_copy(self, cpu["kv"], indices))
        outcome = fuzz(DSA_PS64, examples=60)
        assert outcome.failure is not None, "a DSA copy without its index cache was not caught"
        assert outcome.failure.divergence.component == "dsa.index_k", outcome.failure

    def test_configs_sglang_cannot_build_are_declined_with_the_reason(self, api):
        """SGLang's indexer refuses the built-in dsa config's small index keys: a ConfigError, never a crash."""
        from poolfuzz.adapters.sglang import build_family

        if api.DSATokenToKVPool is None:
            pytest.skip("no DSA pool in this release")
        with pytest.raises(ConfigError, match="refuse"):
            build_family(CONFIGS["dsa"])


class TestScaledPools:
    def test_mxfp8_runs_or_is_declined_with_the_reason(self, api, fuzz):
        """Where MXFP8 backs up and restores on this device the K/V scales are checked; else a reason."""
        from poolfuzz.adapters.sglang import build_family, unsupported_reason

        why = unsupported_reason(MXFP8)
        if why is not None:
            assert "MXFP8" in why
            with pytest.raises(ConfigError, match="MXFP8"):
                build_family(MXFP8)
            return
        fam = build_family(MXFP8)
        assert {"full.k_scale", "full.v_scale"} <= {c.name for c in fam.components()}
        assert fuzz(MXFP8, examples=10).failure is None

    def test_a_block_size_sglang_does_not_use_is_declined(self, api):
        from poolfuzz.adapters.sglang import unsupported_reason

        if api.MHATokenToKVPoolMXFP8 is None:
            pytest.skip("no MXFP8 pool in this release")
        assert "kv_scale_block = 32" in unsupported_reason(CONFIGS["fp8-scaled"])

