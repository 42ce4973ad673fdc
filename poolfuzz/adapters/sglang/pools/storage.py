"""SGLang's KV pools that store KV other than as K and V rows: MLA, DSA, MiniMax sparse and MXFP8 block-scaled.

Each is built by the release's own configurator for the config's server. A release without the class declines the
config here; what SGLang refuses of the config's shapes (DSA's indexer takes 128-value keys on 64-token pages) is the
configurator's to say, building the server, and a layout other than poolfuzz reads is declined on the built pool.
Every buffer the pool's ``get_cpu_copy`` / ``load_cpu_copy`` carries is a component the harness
checksums, except DSA's index scales: four bytes a token in SGLang's layout, too few to carry a
tag (the built-in family checks them, with wider scales).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, first_importable
from poolfuzz.adapters.sglang.pools.mha_fp4 import mha_fp4_components, mha_fp4_problem
from poolfuzz.adapters.sglang.pools.minimax import msa_components, msa_problem
from poolfuzz.adapters.sglang.pools.reads import read_door
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.latent import latent_components


def single_rank(api: SGLangAPI) -> None:
    """Releases whose pools read the runtime's parallel context (MLA's decode-context-parallel
    width) need one: with nothing published, state the single rank a CPU run is."""
    if api.get_parallel is None:
        return
    ctx = api.get_parallel()
    unset = {}
    # Each width a pool may read, at its single-rank value (0.5.20's MLA retraction reads
    # dcp_enabled, 0.5.23's attn_dcp_size and attn_dcp_rank).
    for width, value in (("dcp_enabled", False), ("attn_dcp_size", 1), ("attn_dcp_rank", 0)):
        try:
            getattr(ctx, width)
        except (RuntimeError, ValueError):
            unset[width] = value
        except AttributeError:  # a release whose context has no such width reads none
            pass
    if unset:
        ctx.override_permanently(**unset)


def storage_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """Why this release cannot build the config's KV storage, or None."""
    kind = storage_of(config)
    if kind.pool_class is not None and getattr(api, kind.pool_class) is None:
        return f"this SGLang has no {kind.pool_class}{kind.pool_class_also}"
    if kind.probe is not None:
        return kind.probe(api, config)
    if config.kv_quant == "fp4_mx_block16":
        return _fp4_problem(api, config) if config.latent else mha_fp4_problem(api, config)
    if config.kv_quant:
        return _quant_problem(api, config)
    if config.kv_scale_block:
        cls = api.MHATokenToKVPoolMXFP8
        if cls is None:
            return "this SGLang has no MHATokenToKVPoolMXFP8 (block-scaled fp8 KV)"
        block = getattr(cls, "MXFP8_SCALE_BLOCK_SIZE", None)
        if block != config.kv_scale_block:
            return f"SGLang's MXFP8 pool scales blocks of {block} values; set kv_scale_block = {block}"
    return None


def what_failed(exc: BaseException) -> str:
    """An exception's message, or for a bare ``assert`` the source line that failed."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if text:
        return text
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].line if frames and frames[-1].line else "no message"


@functools.cache
def index_put_lacks_ue8m0(device: torch.device) -> bool:
    """Whether this torch has no ``index_put`` for UE8M0 (``float8_e8m0fnu``) on ``device``: its CPU
    build (2.13 among them) has none, while indexing, slicing and ``.to`` work."""
    ue8m0 = getattr(torch, "float8_e8m0fnu", None)
    if ue8m0 is None:
        return False
    probe = torch.zeros(2, dtype=ue8m0, device=device)
    try:
        probe[torch.tensor([0], device=device)] = probe[1:]
    except (NotImplementedError, RuntimeError):
        return True
    return False


def scales_as_bytes(pool) -> bool:
    """A call-time stand-in, as :func:`~poolfuzz.adapters.sglang.shims.cpu_synchronize` is: where torch
    cannot index-put UE8M0 on the pool's device, hand the MXFP8 pool its scale buffers as their bytes
    (``view(torch.uint8)``, the same memory). A UE8M0 scale is one byte, and the per-slot layout's paths
    only move scales (backup, restore, ``move_kv_cache``), so every move copies the same bytes it would
    have. Returns whether it did; the page-interleaved layout (Triton kernels only) is left alone."""
    bufs = list(pool.k_scale_buffer) + list(pool.v_scale_buffer)
    if (not bufs or getattr(pool, "mxfp8_sf_interleaved", False) or bufs[0].dtype == torch.uint8
            or not index_put_lacks_ue8m0(bufs[0].device)):
        return False
    pool.k_scale_buffer = [b.view(torch.uint8) for b in pool.k_scale_buffer]
    pool.v_scale_buffer = [b.view(torch.uint8) for b in pool.v_scale_buffer]
    return True


def storage_components(api: SGLangAPI, config: ModelConfig, pool) -> list[Component]:
    """The components of the MLA, DSA, MiniMax sparse, FP4 or MXFP8 pool SGLang's configurator built for a
    full-attention-only config's server (``pool``)."""
    c = config
    problem = storage_problem(api, c)
    if problem:
        raise ConfigError(f"config {c.name!r} on sglang {api.version}: {problem}")
    if problem := buffers_problem(pool, c):
        raise ConfigError(f"config {c.name!r}: {problem}")
    if storage_of(c).builds_own_pool:  # MiniMax's sparse pool: its own doors
        return msa_components(pool, c)
    single_rank(api)
    if c.kv_quant == "fp4_mx_block16" and not c.latent:
        return mha_fp4_components(pool, c)
    if c.kv_scale_block:
        scales_as_bytes(pool)
        return _scaled_components(pool, c)
    if c.kv_quant:
        return _fp4_components(pool, c)
    return _latent_components(pool, c)


def buffers_problem(pool, c: ModelConfig) -> str | None:
    """Which kinds of buffer the config's components live in the KV pool SGLang built (for a hybrid linear model,
    its full-attention sub-pool) keeps none of, in a decline's words; None where it keeps them all."""
    lacking = _buffers_lacking(pool, c)
    if not lacking:
        return None
    return (f"SGLang built its server's KV pool as {type(pool).__name__}, which keeps no {' or '.join(lacking)}: no "
            "server of this release keeps the config's KV so")


def _buffers_lacking(pool, c: ModelConfig) -> list[str]:
    kind = storage_of(c)
    needs = [("main_pool", "MiniMax sparse sub-pools")] if kind.builds_own_pool else []
    if c.latent:
        needs.append(("kv_buffer", "latent rows"))
    if kind.index_cache:
        needs.append(("index_k_with_scale_buffer", "DSA index cache"))
    if c.kv_scale_block or (c.kv_quant == "fp4_mx_block16" and not c.latent):
        needs.append(("k_scale_buffer", "scale rows"))
    elif c.kv_quant and c.latent:
        needs.append(("kv_scale_buffer", "scale rows"))
    return [what for attribute, what in needs if getattr(pool, attribute, None) is None]


def _latent_components(pool, c: ModelConfig) -> list[Component]:
    r = c.kv_lora_rank
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        # the latent row as the MLA kernels get it (``get_key_buffer``: the compressed part then the rope part)
        buf = read_door(pool, "get_key_buffer", layer_id, pool.kv_buffer[local])
        out += latent_components(buf[:, 0], r, layer=layer_id)
    if storage_of(c).index_cache:
        ps = pool.page_size // getattr(pool, "index_kpool", 1)
        if ps != c.page_size:
            raise ConfigError(f"config {c.name!r}: SGLang's DSA index pages hold {ps} tokens, not page_size "
                              f"{c.page_size}; poolfuzz reads them by the KV page")
        for local, layer_id in enumerate(c.full_layer_ids):
            buf = pool.index_k_with_scale_buffer[local]
            keys = buf[:, :ps * c.index_head_dim].view(-1, ps, c.index_head_dim)
            out.append(Component(name="dsa.index_k", layer=layer_id, space="full", tensor=keys, page_size=ps))
    return out


def _scaled_components(pool, c: ModelConfig) -> list[Component]:
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        # This pool stores K and V as float8_e4m3fn and the scales as UE8M0: the harness writes and
        # reads their bytes (as SGLang's other fp8 pools store them: uint8)
        out.append(Component(name="full.k", layer=layer_id, space="full", tensor=pool.k_buffer[local].view(torch.uint8)))
        out.append(Component(name="full.v", layer=layer_id, space="full", tensor=pool.v_buffer[local].view(torch.uint8)))
        for name, buf in (("full.k_scale", pool.k_scale_buffer[local]), ("full.v_scale", pool.v_scale_buffer[local])):
            if buf.dim() != 3:
                raise ConfigError(f"config {c.name!r}: SGLang's MXFP8 scales are interleaved by page here "
                                  f"(shape {tuple(buf.shape)}); poolfuzz reads per-slot scales only")
            out.append(Component(name=name, layer=layer_id, space="full", tensor=buf.view(torch.uint8)))
    return out


_QUANT_GETTER = "sglang.srt.layers.quantization.fp4_kv_cache_quant_method:get_kv_cache_quant_method"
_FP4_POOL = "sglang.srt.mem_cache.memory_pool:MLATokenToKVPoolFP4"


def _quant_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """A release without KV quant methods declines the config; whether it builds the config's method is its
    configurator's to say, building the server's pool."""
    if first_importable(_QUANT_GETTER, required=False) is None:
        return "this SGLang has no KV cache quant methods (get_kv_cache_quant_method)"
    return None


def _fp4_problem(api: SGLangAPI, config: ModelConfig) -> str | None:
    """A release (or torch) without the FP4 MLA pool declines the config; its rows' layout is checked on the pool
    SGLang's configurator built (``_fp4_components``)."""
    if first_importable(_FP4_POOL, required=False) is None or not hasattr(torch, "float4_e2m1fn_x2"):
        return "this SGLang (or torch) has no FP4 MLA KV pool (MLATokenToKVPoolFP4, float4_e2m1fn_x2)"
    return None


def _fp4_components(pool, c: ModelConfig) -> list[Component]:
    """The packed latent row's two parts (the compressed part's bytes, then the rope part's) and its scale row.
    Read from the buffers: the pool's ``get_key_buffer`` hands the kernels a dequantised copy."""
    width = c.kv_lora_rank + c.qk_rope_head_dim
    shapes = (tuple(pool.kv_buffer[0].shape[1:]), tuple(pool.kv_scale_buffer[0].shape[1:]))
    if shapes != ((1, width // 2), (width // 16,)):
        raise ConfigError(f"config {c.name!r}: SGLang's FP4 MLA rows are laid out as {shapes}, not as packed bytes "
                          "and a scale byte per 16 values, as poolfuzz reads them")
    half = c.kv_lora_rank // 2
    out = []
    for local, layer_id in enumerate(c.full_layer_ids):
        out += latent_components(pool.kv_buffer[local][:, 0], half, layer=layer_id)
        out.append(Component(name="mla.scale", layer=layer_id, space="full", tensor=pool.kv_scale_buffer[local]))
    return out


@dataclass(frozen=True, kw_only=True)
class SGLangStorage:
    """What the adapter builds and drives on SGLang for one attention kind (``poolfuzz.pools.attention_kinds``),
    decided here once: its pool class, what the installed release must accept, and which of SGLang's host paths
    run it here (a ``str`` field says why one does not; None: it does)."""

    name: str
    pool_class: str | None = None  # the SGLangAPI attribute of its pool; None: checked by ``probe``, or MHA's by quant
    pool_class_also: str = ""  # the class's other names, for the message where a release has none
    probe: Callable[[SGLangAPI, ModelConfig], str | None] | None = None  # the release lacking its pool (MiniMax's)
    builds_own_pool: bool = False  # its components read by its own module (MiniMax's), not by the latent reader
    index_cache: bool = False  # DSA's page-major index-key cache beside the latent rows (dsa.index_k)
    set_kv_buffer_door: bool = True  # its pool takes K/V rows through set_kv_buffer (MiniMax's has its own door)
    host_side_pools: bool = False  # its host group holds pools beside the KV (index keys): the v2 store interface
    host_page_head: bool = True  # its host pools have the page_head layout (MiniMax's K-only index pool has not)
    host_tier: str | None = None  # why SGLang's HiCache host tier is not driven for it
    unified: str | None = None  # why SGLang's unified pool is not driven for it ({version}: the release)

    @property
    def own_pool(self) -> bool:
        """Its full-attention KV is a pool of its own (MLA, DSA, MiniMax sparse), not SGLang's per-head MHA pool."""
        return self.pool_class is not None or self.builds_own_pool


STORAGE: dict[str, SGLangStorage] = {k.name: k for k in (
    SGLangStorage(name="mha"),
    SGLangStorage(name="mla", pool_class="MLATokenToKVPool"),
    SGLangStorage(name="dsa", pool_class="DSATokenToKVPool", pool_class_also=" (or NSATokenToKVPool)",
                  index_cache=True,
                  # its host transfers synchronise a device stream; a CPU stream has no synchronize
                  host_tier="DSA host pools are not driven (their transfers synchronise a device stream, which the "
                            "CPU lacks)",
                  # the configurator would pass use_mla_backend=True and nothing of the indexer: the pool it builds
                  # has no index-key buffer for poolfuzz to check
                  unified="SGLang {version}'s unified Mamba factory (init_unified_mamba_pools) builds an MLA sub-pool "
                          "without DSA's index-key cache (it takes no index_head_dim); use --family sglang"),
    SGLangStorage(name="msa", probe=msa_problem, builds_own_pool=True,
                  set_kv_buffer_door=False, host_side_pools=True, host_page_head=False),
)}


def storage_of(config: ModelConfig) -> SGLangStorage:
    """How the adapter stores and drives ``config``'s full attention on SGLang."""
    return STORAGE[config.attention]
