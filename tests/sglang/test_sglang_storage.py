"""SGLang's MLA, DSA and MXFP8 KV pools, built by the installed release and fuzzed through the harness."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError

# SGLang's DSA indexer asserts 128-value index keys on 64-token pages; MXFP8 scales blocks of 32.
DSA_PS64 = CONFIGS["dsa-ps64"]
MXFP8 = CONFIGS["fp8-scaled"]
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
        assert fuzz(CONFIGS["fp8-scaled-ps4"], examples=10).failure is None

    def test_tree_drafts_run_or_are_declined_with_what_the_native_move_raises(self, api):
        """0.5.21-0.5.23's native move reads ``native_k_scale_buffer``, which the MXFP8 pool never sets: the
        family says so instead of counting tree verifies in (0.5.20 moves, and moves the scales twice)."""
        from poolfuzz.adapters.sglang import build_family, unsupported_reason

        if api.MHATokenToKVPoolMXFP8 is None or unsupported_reason(MXFP8):
            pytest.skip("MXFP8 is not driven with this release here")
        fam = build_family(MXFP8)
        if fam.supports_tree_drafts:
            assert "tree_drafts" not in fam.declined
        else:
            assert "move_kv_cache (native) raises" in fam.declined["tree_drafts"], fam.declined

    def test_a_restore_that_drops_the_scales_is_caught(self, api, fuzz, monkeypatch):
        """The MXFP8 restore writes the fp8 payload and not its scales: the resumed request would
        dequantise against another request's exponents. The scale components name it."""
        from poolfuzz.adapters.sglang import unsupported_reason

        if api.MHATokenToKVPoolMXFP8 is None or unsupported_reason(MXFP8):
            pytest.skip("MXFP8 is not driven with this release here")
        monkeypatch.setattr(api.MHATokenToKVPoolMXFP8, "_write_scales", lambda self, idx, loc, k, v: None)
        outcome = fuzz(MXFP8, examples=60)
        assert outcome.failure is not None, "a restore without the scales was not caught"
        assert outcome.failure.divergence.component in ("full.k_scale", "full.v_scale"), outcome.failure

    def test_mxfp8_on_the_cpu_is_driven_through_the_scale_bytes(self, api):
        """torch's CPU build cannot index-put UE8M0: the pool gets its scale buffers as their bytes, the
        same memory, and backs a slot's scales up and restores them to another slot byte for byte."""
        import torch

        from poolfuzz.adapters.sglang.api import construct
        from poolfuzz.adapters.sglang.shims import cpu_synchronize
        from poolfuzz.adapters.sglang.pools.storage import index_put_lacks_ue8m0, scales_as_bytes

        if api.MHATokenToKVPoolMXFP8 is None:
            pytest.skip("no MXFP8 pool in this release")
        if not index_put_lacks_ue8m0(torch.device("cpu")):
            pytest.skip("this torch index-puts UE8M0 on the CPU: no stand-in needed")
        pool = construct(api.MHATokenToKVPoolMXFP8, size=8, page_size=1, dtype=torch.float8_e4m3fn, head_num=1,
                         head_dim=64, layer_num=1, device="cpu", enable_memory_saver=False,
                         enable_kvcache_transpose=False)
        storage = pool.k_scale_buffer[0].untyped_storage().data_ptr()
        assert scales_as_bytes(pool)
        assert pool.k_scale_buffer[0].untyped_storage().data_ptr() == storage
        pool.k_scale_buffer[0][3] = torch.tensor([[7, 9]], dtype=torch.uint8)
        with cpu_synchronize(torch.device("cpu")):
            try:
                backup = pool.get_cpu_copy(torch.tensor([3]))
            except NotImplementedError as exc:  # 0.5.18: "CPU offloading is unsupported for MXFP8 KV cache"
                pytest.skip(f"sglang {api.version}'s MXFP8 pool backs up nothing: {exc}")
            pool.load_cpu_copy(backup, torch.tensor([5]))
        assert pool.k_scale_buffer[0][5].tolist() == [[7, 9]]
        assert not scales_as_bytes(pool)  # once is enough

    def test_a_block_size_sglang_does_not_use_is_declined(self, api):
        from poolfuzz.adapters.sglang import unsupported_reason

        if api.MHATokenToKVPoolMXFP8 is None:
            pytest.skip("no MXFP8 pool in this release")
        block16 = CONFIGS["fp8-scaled"].replace(name="fp8-block16", kv_scale_block=16)
        assert "kv_scale_block = 32" in unsupported_reason(block16)

