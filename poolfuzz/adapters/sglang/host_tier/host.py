"""The CPU copies of SGLang's host tier, and whether the release has the decode server's host_pool retraction backup.

On a PD decode server SGLang backs a retracted request up into a reserved HiCache host pool instead of per-request
CPU tensors (``--disaggregation-decode-retraction-backup host_pool``, resolved from the KV pool when unset). The path
is SGLang's own, end to end (``scheduler/decode_server.py`` starts it): ``mem_cache.common.backup_kv_cache`` /
``restore_kv_cache`` / ``discard_kv_cache_backup`` through the ``UnifiedRadixCache`` and its ``HybridCacheController``.
:func:`host_pool_path_present` says whether the installed release has it (``describe()``).

One call-time stand-in: the ``direct`` backend's copies (``sgl_kernel.kvcacheio.transfer_kv_direct`` and, for
page-first host layouts, ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf``) are imported
by the host pool modules only under CUDA/ROCm/XPU. Where they are missing (a CPU-only machine)
:func:`install_cpu_transfer_ops` gives those modules torch copies with their contracts (for each layer,
``dst[dst_indices] = src[src_indices]``, a page-first buffer indexed ``[page, layer, offset]``); SGLang's own kernels
are never replaced where they exist.
"""

from __future__ import annotations

import importlib
import inspect
import types
from functools import lru_cache

import torch

from poolfuzz.adapters.sglang.host_tier.kernel_io import install_missing_copies
from poolfuzz.adapters.sglang.compat import private_name

HOST_LAYOUT = "layer_first"  # what a decode server's host receive resolves (handle_hicache)
IO_BACKEND = "direct"  # the backend whose copies take tensors; "kernel" takes raw pointer tables (kernel_io.py)

# The tree methods a host_pool retraction runs (three of them
# UnifiedRadixCache keeps private: compat.PRIVATE names them).
TREE_METHODS = ("backup_kv_cache", "restore_kv_cache", "discard_kv_cache_backup",
                *(private_name(k) for k in ("retraction_device_transfers", "reclaim_retraction_host",
                                            "build_sidecar_transfers")))


def cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``transfer_kv_direct``'s contract on the CPU: each layer's rows ``src_indices`` into ``dst_indices``."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("Source and destination layers must have the same number of layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source rows, {dst_indices.numel()} destination")
    src, dst = src_indices.to(torch.int64).cpu(), dst_indices.to(torch.int64).cpu()
    for s, d in zip(src_layers, dst_layers):
        d[dst.to(d.device)] = s[src.to(s.device)].to(d.device)


def _page_rows(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page numbers of token indices that come in whole pages (each page's first index)."""
    return indices.to(torch.int64).cpu()[::page_size] // page_size


def cpu_transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """``transfer_kv_per_layer_direct_pf_lf``'s contract on the CPU: host buffers page-first
    ``[pages, layers, page_size, ...]`` (one, or K then V) into layer-first device rows; ``dst_ptrs``
    holds the device buffers of consecutive layers from ``layer_id`` (K ones, then V ones)."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_per_layer_direct_pf_lf: {src_indices.numel()} source rows, "
                         f"{dst_indices.numel()} destination")
    if src_indices.numel() == 0:
        return
    pages, dst = _page_rows(src_indices, page_size), dst_indices.to(torch.int64).cpu()
    layers = len(dst_ptrs) // len(src_ptrs)
    for which, src in enumerate(src_ptrs):
        for j in range(layers):
            out = dst_ptrs[which * layers + j]
            rows = src[pages.to(src.device), layer_id + j]
            out[dst.to(out.device)] = rows.reshape(-1, *rows.shape[2:]).to(out.device)


def cpu_transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """``transfer_kv_all_layer_direct_lf_pf``'s contract on the CPU: layer-first device rows of every
    layer (K ones, then V ones) into page-first host buffers ``[pages, layers, page_size, ...]``."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_all_layer_direct_lf_pf: {src_indices.numel()} source rows, "
                         f"{dst_indices.numel()} destination")
    if src_indices.numel() == 0:
        return
    src, pages = src_indices.to(torch.int64).cpu(), _page_rows(dst_indices, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
    for which, out in enumerate(dst_ptrs):
        for j in range(layers):
            layer = src_ptrs[which * layers + j]
            rows = layer[src.to(layer.device)].reshape(len(pages), page_size, *layer.shape[1:])
            out[pages.to(out.device), j] = rows.to(out.device)


# The ``direct`` backend's copies, by the name each host pool module calls them under.
CPU_TRANSFER_OPS = {"transfer_kv_direct": cpu_transfer_kv_direct,
                    "transfer_kv_per_layer_direct_pf_lf": cpu_transfer_kv_per_layer_direct_pf_lf,
                    "transfer_kv_all_layer_direct_lf_pf": cpu_transfer_kv_all_layer_direct_lf_pf}


def install_cpu_transfer_ops() -> list[str]:
    """Give the host pool modules the ``direct`` copies where their CUDA-only import left them out."""
    return install_missing_copies(CPU_TRANSFER_OPS)


@lru_cache(maxsize=1)
def _hicache_api():
    """SGLang's host_pool retraction pieces, or None where the release has no such path."""
    try:
        common = importlib.import_module("sglang.srt.mem_cache.common")
        mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
        mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
        group = importlib.import_module("sglang.srt.mem_cache.pool_host.group")
        assembler = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
        controller = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
        storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        tree = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    except Exception:  # absent, or it fails to import on this machine: either way the release has no such path here
        return None
    backup = getattr(common, "backup_kv_cache", None)
    if backup is None or "backend" not in inspect.signature(backup).parameters:
        return None
    if not all(hasattr(tree.UnifiedRadixCache, m) for m in TREE_METHODS):
        return None
    return types.SimpleNamespace(common=common, mha=mha, mla=mla, HostPoolGroup=group.HostPoolGroup,
                                 build_pool_entry=assembler.build_pool_entry,
                                 HybridCacheController=controller.HybridCacheController,
                                 PoolName=storage.PoolName, UnifiedRadixCache=tree.UnifiedRadixCache)


def host_pool_path_present() -> bool:
    """Whether the installed SGLang has the decode server's host_pool retraction backup."""
    return _hicache_api() is not None
