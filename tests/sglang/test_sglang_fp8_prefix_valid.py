"""An engine defect judged this stop (stop 55), anchored: off CUDA and ROCm, SGLang 0.5.14 to 0.5.21's
``MHATokenToKVPool.set_kv_buffer_prefix_valid`` converts FP8 KV twice (fixed in 0.5.22, no PR found).

The method views the model's rows as the pool's storage bytes, then, on a device that is neither CUDA nor HIP, hands
those bytes to ``set_kv_buffer``, which converts them to fp8 again as numbers (the byte 1 becomes 1.0, 0x38). Only
DFlash's draft pool calls that door in a server; the pools path found it by routing a chain verify through it
(``dense-ps4`` ``StateLost:contents:full@decode_speculative`` on 0.5.14 and 0.5.15, replayed on 0.5.18)."""

import pytest
import torch
from packaging.version import Version


def _stored_both_ways(api):
    """One token's K written through ``set_kv_buffer`` (slot 3) and through ``set_kv_buffer_prefix_valid`` (slot 5),
    from the same bfloat16 row, into a CPU fp8 pool."""
    from poolfuzz.adapters.sglang.api import construct

    pool = construct(api.MHATokenToKVPool, size=16, page_size=1, dtype=torch.float8_e4m3fn, head_num=2, head_dim=8,
                     layer_num=1, device="cpu", enable_memory_saver=False, enable_kvcache_transpose=False)

    class Layer:
        layer_id = 0
        is_cross_attention = False

    rows = (torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 8) / 64).to(torch.bfloat16)
    pool.set_kv_buffer(Layer(), torch.tensor([3]), rows[:1].clone(), rows[:1].clone())
    pool.set_kv_buffer_prefix_valid(Layer(), torch.tensor([[5, 6]]), torch.tensor([1]), rows.clone(), rows.clone())
    keys = pool.k_buffer[0]
    return keys[3].view(torch.uint8), keys[5].view(torch.uint8)


@pytest.mark.anchored
def test_the_prefix_valid_door_stores_fp8_rows_as_the_plain_door_does_from_0_5_22(api):
    if not hasattr(api.MHATokenToKVPool, "set_kv_buffer_prefix_valid"):
        pytest.skip(f"sglang {api.version}'s MHA pool has no set_kv_buffer_prefix_valid")
    plain, prefix_valid = _stored_both_ways(api)
    if Version(api.version) >= Version("0.5.22"):
        assert torch.equal(plain, prefix_valid), (plain.tolist(), prefix_valid.tolist())
    else:  # the bytes converted twice: the same row lands as other bytes
        assert not torch.equal(plain, prefix_valid), plain.tolist()
