"""fp8 KV written through a quantising write door: SGLang's CPU fp8 KV cache (the ``cpu_fp8_e4m3`` method)."""

from __future__ import annotations

import torch

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.kv import MHATokenToKVPool

# The quantisation methods a config may name (``ModelConfig.kv_quant``): one fp8 byte a value, per-tensor
# scale 1, the K and V buffers in the store dtype itself (no scale buffers, no dequant workspace).
KV_QUANTS = ("cpu_fp8_e4m3",)
# What the model hands the door: float16, in which every fp8 e4m3 byte (its NaNs included) round-trips.
MODEL_DTYPE = torch.float16


# Both conversions run on the CPU, where SGLang's CPU fp8 method runs: torch's CUDA casts to and from fp8 turn
# every NaN into the canonical 0x7F (the sign of 0xFF is lost), so on a CUDA device a row holding a 0xFF byte came
# back torn (found by ci/gpu-check.sh on an H200, the first CUDA run).


def quantise(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``(x / scale).to(fp8)`` as bytes, as SGLang's ``CPUFP8KVCacheMethod.quantize_and_store`` stores them."""
    return (rows.cpu() / scale).to(torch.float8_e4m3fn).view(torch.uint8).to(rows.device)


def as_model_rows(rows: torch.Tensor) -> torch.Tensor:
    """The harness's rows (fp8 bytes) as the model dtype an attention layer computes K and V in."""
    return rows.cpu().view(torch.float8_e4m3fn).to(MODEL_DTYPE).to(rows.device)


class MHATokenToKVPoolQuantised(MHATokenToKVPool):
    """SGLang's ``MHATokenToKVPool`` built with a KV quant method (``quant_method=``): ``set_kv_buffer`` hands
    each layer's K and V, in the model's dtype, to the method, which quantises them into the fp8 buffers at
    the batch's slots. Storage, copies, moves and host pools are the plain pool's."""

    writes_through_engine = True

    def write_rows(self, slots, rows: dict) -> set:
        """The forward's door: per layer, K and V in the model dtype, quantised into the slots."""
        idx = as_index(slots).to(self.device)
        done = set()
        for local, layer_id in enumerate(self.layer_ids):
            k, v = (f"{self.name}.k", layer_id), (f"{self.name}.v", layer_id)
            if k in rows and v in rows:
                self.quantize_and_store(local, idx, as_model_rows(rows[k]), as_model_rows(rows[v]))
                done |= {k, v}
        return done

    def quantize_and_store(self, local: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.k_buffer[local][loc] = quantise(cache_k)
        self.v_buffer[local][loc] = quantise(cache_v)
