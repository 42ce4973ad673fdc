"""SGLang's FP4 MHA KV cache (``--kv-cache-dtype fp4_mx_block16`` on an MHA model), as its configurator builds it.

Releases with KV cache quant methods (0.5.23) build ``MHATokenToKVPool`` with ``quant_method=`` the registry's
``FP4MXBlock16KVCacheMethod`` (``kv_cache_configurator._build_mha_quant_method`` / ``_build_fp4_quant_method``),
whose ``create_buffers`` gives the pool packed K and V and a scale row per token beside each; the class
``MHATokenToKVPoolFP4`` is still defined there, but nothing in those releases constructs it. Earlier releases (0.5.9)
construct ``MHATokenToKVPoolFP4`` itself for an fp4 ``kv_cache_dtype``. Either way the pool stores the same four
buffers, which are the components; the harness writes their bytes directly (the quantiser is a
``torch.compile``d kernel whose scale bytes cannot carry a tag), and reads them through the pool's raw door
(``get_raw_kv_buffer``, what a native-FP4 backend reads) where the release has one: its ``get_key_buffer`` hands the
kernels a dequantised copy.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError


def mha_fp4_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """A torch without SGLang's FP4 dtype declines the config; the rows' layout is checked on the pool SGLang's
    configurator built (``mha_fp4_components``)."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return "this torch has no float4_e2m1fn_x2 (SGLang's fp4 KV cache dtype)"
    return None


def mha_fp4_components(pool, c: ModelConfig) -> list[Component]:
    """The four components per layer of the FP4 MHA pool SGLang's configurator built for the config's server."""
    n, d = c.head_num, c.head_dim
    shapes = (tuple(pool.k_buffer[0].shape[1:]), tuple(pool.k_scale_buffer[0].shape[1:]))
    if shapes != ((n, d // 2), (n * d // 16,)):
        raise ConfigError(f"config {c.name!r}: SGLang's FP4 MHA rows are laid out as {shapes}, not as packed bytes and "
                          "a scale byte per 16 values of a token, as poolfuzz reads them")
    raw = getattr(pool, "get_raw_kv_buffer", None)
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        own = (pool.k_buffer[local], pool.v_buffer[local], pool.k_scale_buffer[local], pool.v_scale_buffer[local])
        got = raw(layer_id) if raw is not None else own
        if [t.data_ptr() for t in got] != [t.data_ptr() for t in own]:
            raise ConfigError(f"config {c.name!r}: {type(pool).__name__}.get_raw_kv_buffer({layer_id}) does not hand "
                              "out the pool's packed K, V and scale buffers in place")
        for name, tensor in zip(("full.k", "full.v", "full.k_scale", "full.v_scale"), got):
            out.append(Component(name=name, layer=layer_id, space="full", tensor=tensor.view(torch.uint8)))
    return out
