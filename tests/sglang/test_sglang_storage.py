"""SGLang's MLA, DSA and MXFP8 KV pools, as the installed release builds them for a server."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError

# SGLang's DSA indexer asserts 128-value index keys on 64-token pages; MXFP8 scales blocks of 32.
DSA_PS64 = CONFIGS["dsa-ps64"]
MXFP8 = CONFIGS["fp8-scaled"]
LATENT = {"mla": CONFIGS["mla"], "mla-ps4": CONFIGS["mla-ps4"], "dsa-ps64": DSA_PS64}


def _family(api, config):
    """The pools of the plain server SGLang's scheduler runs for ``config``, or the test skipped with its reason."""
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver, unsupported_reason

    why = unsupported_reason(config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_driver(config).family


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

    def test_configs_sglang_cannot_build_are_declined_with_the_reason(self, api):
        """SGLang's indexer refuses the built-in dsa config's small index keys: declined, never a crash."""
        from poolfuzz.adapters.sglang.scheduler.servers import build_driver, unsupported_reason

        if api.DSATokenToKVPool is None:
            pytest.skip("no DSA pool in this release")
        assert unsupported_reason(CONFIGS["dsa"]) is not None
        with pytest.raises(ConfigError):
            build_driver(CONFIGS["dsa"])


class TestScaledPools:
    def test_mxfp8_components_are_the_pools_scales(self, api):
        """Where a server builds MXFP8 here, its K/V scales are components the checks read."""
        fam = _family(api, MXFP8)
        assert {"full.k_scale", "full.v_scale"} <= {c.name for c in fam.components()}

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
        from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason

        if api.MHATokenToKVPoolMXFP8 is None:
            pytest.skip("no MXFP8 pool in this release")
        block16 = CONFIGS["fp8-scaled"].replace(name="fp8-block16", kv_scale_block=16)
        assert "kv_scale_block = 32" in unsupported_reason(block16)

