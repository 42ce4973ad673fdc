"""Catalogue faults of quantised KV pools: the quantiser stores wrongly, or a copy leaves the scales behind."""

from __future__ import annotations

from poolfuzz.pools.kv import MHATokenToKVPool
from poolfuzz.pools.latent import MLATokenToKVPool
from poolfuzz.pools.latent_fp4 import MLATokenToKVPoolFP4
from poolfuzz.pools.mha_fp4 import MHATokenToKVPoolFP4
from poolfuzz.pools.quantised import MHATokenToKVPoolQuantised


class QuantStoreSkipsLastToken(MHATokenToKVPoolQuantised):
    """The quantise-and-store walks the batch's slots one short (a tile count rounded down): the last token
    of every forward is never stored, and its slot keeps whatever was there before (zeros, or the poison
    of its last owner). The correct method stores every slot of ``loc``."""

    def quantize_and_store(self, local, loc, cache_k, cache_v):
        super().quantize_and_store(local, loc[:-1], cache_k[:-1], cache_v[:-1])


class FP4CopyWithoutScales(MLATokenToKVPoolFP4):
    """The retraction backup is the plain MLA pool's: it copies the packed latent rows and not the scale rows,
    so a resumed request's rows dequantise against whatever scales their new slots held (SGLang 0.5.23's
    ``MLATokenToKVPoolFP4`` overrides neither ``get_cpu_copy`` nor ``load_cpu_copy``). The correct copy
    carries both, as SGLang's MXFP8 pool does for its scales."""

    get_cpu_copy = MLATokenToKVPool.get_cpu_copy
    load_cpu_copy = MLATokenToKVPool.load_cpu_copy


class FP4MHACopyWithoutScales(MHATokenToKVPoolFP4):
    """The retraction backup is the plain MHA pool's: it copies the packed K and V rows and not their scale rows,
    so a resumed request's K and V dequantise against whatever scales their new slots held (SGLang 0.5.23's
    ``MHATokenToKVPool.get_cpu_copy`` / ``load_cpu_copy`` carry ``k_buffer`` and ``v_buffer`` only, also when its
    FP4 quant method gave it scale buffers). The correct copy carries both, as SGLang's MXFP8 pool does."""

    get_cpu_copy = MHATokenToKVPool.get_cpu_copy
    load_cpu_copy = MHATokenToKVPool.load_cpu_copy
