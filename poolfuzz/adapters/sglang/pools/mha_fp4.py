"""SGLang's FP4 MHA KV cache (``--kv-cache-dtype fp4_mx_block16`` on an MHA model), built the way the release builds it.

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

from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable, construct
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

_REGISTRY = "sglang.srt.layers.quantization.fp4_kv_cache_quant_method:KV_CACHE_QUANT_REGISTRY"
_POOL = "sglang.srt.mem_cache.memory_pool:MHATokenToKVPoolFP4"
# The CPU attention backend among those the recipe serves (its prefill and decode accesses: plain reads)
_BACKEND = "torch_native"
_PROBE: dict[tuple, str | None] = {}


def _quant_method(config: ModelConfig, device: str):
    """The release's FP4 quant method, configured as the configurator does for a torch-native server; None
    where the release has no quant-method entry for it (it builds ``MHATokenToKVPoolFP4`` instead)."""
    registry = first_importable(_REGISTRY, required=False)
    if registry is None or config.kv_quant not in registry:
        return None
    # the registry's class with the keywords this release's takes (0.5.18's takes no page_size)
    method = construct(registry[config.kv_quant], num_layers=config.full_layers, device=device,
                       page_size=config.page_size)
    configure = getattr(method, "configure_attention_backends", None)  # releases that select accesses
    if configure is not None:
        configure(_BACKEND, _BACKEND)
    return method


def _pool(api: SGLangAPI, config: ModelConfig, *, size: int, layers: int, common: dict):
    args = dict(common, size=size, layer_num=layers, dtype=torch.float4_e2m1fn_x2)
    method = _quant_method(config, common["device"])
    if method is not None:
        return construct(api.MHATokenToKVPool, quant_method=method, **args)
    cls = first_importable(_POOL, required=False)
    if cls is None:
        raise ConfigError("this SGLang has neither an fp4_mx_block16 KV quant method nor MHATokenToKVPoolFP4")
    return construct(cls, **args)


def mha_fp4_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """Build a one-page pool of the config's heads: the release must store K and V as packed bytes with a scale
    byte per 16 values of a token, as poolfuzz reads them."""
    key = (config.head_num, config.head_dim, config.page_size)
    if key not in _PROBE:
        problem = None
        if not hasattr(torch, "float4_e2m1fn_x2"):
            problem = "this torch has no float4_e2m1fn_x2 (SGLang's fp4 KV cache dtype)"
        else:
            try:
                common = dict(page_size=config.page_size, head_num=config.head_num, head_dim=config.head_dim,
                              device="cpu", enable_memory_saver=False, enable_kvcache_transpose=False)
                pool = _pool(api, config, size=config.page_size, layers=1, common=common)
                n, d = config.head_num, config.head_dim
                shapes = (tuple(pool.k_buffer[0].shape[1:]), tuple(pool.k_scale_buffer[0].shape[1:]))
                if shapes != ((n, d // 2), (n * d // 16,)):
                    problem = f"its FP4 MHA rows are laid out as {shapes}, not packed bytes and 16-value scales"
            except Exception as exc:  # what the release's constructors refuse varies
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                problem = f"SGLang {api.version} cannot build an FP4 MHA pool here ({type(exc).__name__}: {first})"
        _PROBE[key] = problem
    return _PROBE[key]


def mha_fp4_components(pool, c: ModelConfig) -> list[Component]:
    """The four components per layer of the FP4 MHA pool SGLang's configurator built for the config's server."""
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
