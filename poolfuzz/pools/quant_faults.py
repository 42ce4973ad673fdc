"""Catalogue faults of a quantising KV write door: the quantiser stores what it was handed wrongly."""

from __future__ import annotations

from poolfuzz.pools.quantised import MHATokenToKVPoolQuantised


class QuantStoreSkipsLastToken(MHATokenToKVPoolQuantised):
    """The quantise-and-store walks the batch's slots one short (a tile count rounded down): the last token
    of every forward is never stored, and its slot keeps whatever was there before (zeros, or the poison
    of its last owner). The correct method stores every slot of ``loc``."""

    def quantize_and_store(self, local, loc, cache_k, cache_v):
        super().quantize_and_store(local, loc[:-1], cache_k[:-1], cache_v[:-1])
