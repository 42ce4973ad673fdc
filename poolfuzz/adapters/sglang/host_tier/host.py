"""SGLang's host_pool retraction backup on the CPU: its HiCache host pools, pool group, controller and tree calls.

On a PD decode server SGLang backs a retracted request up into a reserved HiCache host pool instead of
per-request CPU tensors (``--disaggregation-decode-retraction-backup host_pool``, inferred from the KV
pool when unset: ``resolve_decode_retraction_backup``). The path is SGLang's own, end to end:
``mem_cache.common.backup_kv_cache`` / ``restore_kv_cache`` / ``discard_kv_cache_backup`` call the
``UnifiedRadixCache``'s ``backup_kv_cache`` / ``restore_kv_cache`` / ``discard_kv_cache_backup``, which
pad the row's token slots to pages, translate the SWA window, allocate host slots through the
``HybridCacheController`` and its ``HostPoolGroup`` (one ``MHATokenToKVPoolHost`` per device sub-pool)
and move the rows with the controller's ``L2TransferEngine`` (write-back: every layer at once; load-back:
layer by layer).

What the adapter supplies is what a server would: the host pools sized by the config
(``host_token_capacity``), the layer-first layout and the I/O backend of :func:`retraction_io_backend`, unpinned memory
(nothing to pin for on a CPU), and a stand-in tree that carries those borrowed methods with the
attributes they read, holding no prefix of its own (so reclaiming host space evicts nothing).

One call-time stand-in: the ``direct`` backend's copies (``sgl_kernel.kvcacheio.transfer_kv_direct`` and,
for page-first host layouts, ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf``)
are imported by the host pool modules only under CUDA/ROCm/XPU. Where they are missing (a CPU-only
machine) :func:`install_cpu_transfer_ops` gives those modules torch copies with their contracts (for each
layer, ``dst[dst_indices] = src[src_indices]``, a page-first buffer indexed ``[page, layer, offset]``);
SGLang's own kernels are never replaced where they exist.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import types
from functools import lru_cache

import torch

from poolfuzz.adapters.sglang.host_tier.kernel_io import install_cpu_kernel_ops, install_missing_copies, register_buffers
from poolfuzz.adapters.sglang.compat import private, private_name
from poolfuzz.adapters.sglang.pools.reads import stored_bytes
from poolfuzz.adapters.sglang.pools.storage import storage_of
from poolfuzz.adapters.sglang.pools.views import FreeListView, as_ints
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.errors import PoolExhausted
from poolfuzz.pools.protocol import window_start
from poolfuzz.pools.request import HostTransfer, RetractionBackup

HOST_LAYOUT = "layer_first"  # what a decode server's host receive resolves (handle_hicache)
IO_BACKEND = "direct"  # the backend whose copies take tensors; "kernel" takes raw pointer tables (kernel_io.py)


def retraction_io_backend(config: ModelConfig) -> str:
    """``--hicache-io-backend`` of the decode server's retraction host pools: SGLang's default, ``kernel``
    (layer-first: ``transfer_kv_per_layer`` / ``transfer_kv_all_layer`` over pointer tables, ``kernel_io``'s
    copies on a CPU), at page size 1; paged configs keep the ``direct`` copies, so both run."""
    return IO_BACKEND if config.page_size > 1 else "kernel"
# The tree methods a host_pool retraction runs, borrowed unchanged onto the stand-in tree (three of them
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


# =============================================================================================
# What the installed release offers, and which configs it backs up into a host pool
# =============================================================================================
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
    """Whether the installed SGLang has the host_pool retraction backup this module drives."""
    return _hicache_api() is not None


def host_pool_problem(api, config: ModelConfig) -> str | None:
    """Why SGLang would not back ``config`` up into a host pool, or None. The config rules are SGLang's
    (``resolve_decode_retraction_backup``, ``create_unified_radix_cache``): an MHA or SWA KV pool with full
    attention layers, no recurrent state; the rest is whether this release has the path at all."""
    if uses_ssm_state(config) or config.has_mamba:
        return "host-pool retraction has no recurrent-state sidecar (SGLang: it does not support Mamba models)"
    if config.kv_scale_block:
        return "the block-scaled host pool (pool_host/mha_mxfp8) is not driven here"
    if config.kv_quant == "fp4_mx_block16":  # 0.5.23's MHATokenToKVPoolHost raises this ValueError for it
        return ("SGLang's MHA host pool refuses an FP4 pool's per-token scales ('MHA host transfers do not support KV "
                "scale layout token'): its decode server needs --disaggregation-decode-retraction-backup cpu_tensor")
    if why := storage_of(config).host_retraction:
        return why
    if config.has_swa and not config.full_layer_ids:
        return "SGLang's host-pool retraction does not support pure-SWA models"
    if config.mamba_track_slots:
        return "mamba extra-buffer mode is not driven through SGLang"
    if _hicache_api() is None:
        return f"SGLang {api.version} has no host_pool retraction backup (mem_cache.common.backup_kv_cache(backend=))"
    if not _host_pools_take_buffer_info():
        return (f"SGLang {api.version}'s host pools are built from the device pool itself (its pools have no "
                "get_device_pool_infos); poolfuzz builds them from the buffer info, as 0.5.23 does")
    return None


@lru_cache(maxsize=1)
def _host_pools_take_buffer_info() -> bool:
    """Whether the device pools describe their buffers for the host pools' constructors (0.5.23)."""
    memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    return hasattr(memory_pool.MHATokenToKVPool, "get_device_pool_infos")


def resolve_backup_mode(api, config: ModelConfig) -> str:
    """The backup SGLang's decode server infers when none is given: host_pool wherever it can, and only
    for an MHA or SWA KV pool; an MLA pool (which SGLang backs up into a host pool when asked) stays on
    cpu_tensor unless asked."""
    return "cpu_tensor" if config.latent or host_pool_problem(api, config) else "host_pool"


# =============================================================================================
# The harness's view of one host pool
# =============================================================================================
class HostFreeListView(FreeListView):
    """One SGLang host pool: its free slots (slot 0 is an ordinary slot) and its K and V rows per layer."""

    def __init__(self, *, space: str, host_pool, layer_ids, latent_width: int | None = None):
        super().__init__(space=space, owner=host_pool, read=lambda: host_free_slots(host_pool),
                         available=host_pool.available_size)
        self.layer_ids = tuple(layer_ids)
        self.latent_width = latent_width  # MLA: the row is [latent | rope] in one buffer per layer

    def free_list_problem(self) -> str | None:
        seen: set[int] = set()
        for u in self.free_pages():
            if u in seen:
                return f"host free list holds duplicates: slot {u} twice (a double free went unseen)"
            seen.add(u)
        return None

    def components(self) -> list[Component]:
        pool = self.owner
        out = []
        for local, layer_id in enumerate(self.layer_ids):
            if self.latent_width is not None:  # MLATokenToKVPoolHost: kv_buffer [layers, slots, 1, width]
                row, r = pool.kv_buffer[local][:, 0], self.latent_width
                out.append(Component(name="host.mla.latent", layer=layer_id, space=self.space, tensor=row[:, :r]))
                out.append(Component(name="host.mla.rope", layer=layer_id, space=self.space, tensor=row[:, r:]))
                continue
            out.append(Component(name=f"{self.space}.k", layer=layer_id, space=self.space,
                                 tensor=stored_bytes(pool.k_buffer[local])))
            out.append(Component(name=f"{self.space}.v", layer=layer_id, space=self.space,
                                 tensor=stored_bytes(pool.v_buffer[local])))
        return out


def host_free_slots(host_pool) -> list[int]:
    """``free_slots`` and the lazily merged ``release_slots`` of an SGLang host pool."""
    parts = [host_pool.free_slots.reshape(-1)] + [t.reshape(-1) for t in host_pool.release_slots]
    return as_ints(torch.cat(parts)) if parts else []


# =============================================================================================
# The backup itself
# =============================================================================================
class SGLangHostBackup:
    """The host pools of one decode node and the stand-in tree whose borrowed methods back requests up."""

    def __init__(self, *, api, config: ModelConfig, req_pool, allocator, kv_pool):
        hc = _hicache_api()
        install_cpu_transfer_ops()
        install_cpu_kernel_ops()
        self.io_backend = retraction_io_backend(config)
        # torch.cpu.Event has no timing; SGLang warns once that transfer timing is off, which is all it is.
        logging.getLogger("sglang.srt.mem_cache.l2_transfer").setLevel(logging.ERROR)
        self.hc = hc
        self.config = config
        self.req_pool = req_pool
        self.allocator = allocator
        layers = max((*config.full_layer_ids, *config.swa_layer_ids)) + 1
        if config.has_swa:
            subs = [("host.full", hc.PoolName.KV, kv_pool.full_kv_pool, config.full_layer_ids),
                    ("host.swa", hc.PoolName.SWA, kv_pool.swa_kv_pool, config.swa_layer_ids)]
        else:
            subs = [("host.full", hc.PoolName.KV, kv_pool, config.full_layer_ids)]
        entries = []
        self.views: dict[str, HostFreeListView] = {}
        for space, name, device_pool, layer_ids in subs:
            host = self._host_pool(device_pool)
            register_buffers(host, device_pool)  # addressable by the kernel backend's copies
            # Transfer layer ids are model layers; each pool maps them to its own (SGLang's layer mappings).
            mapping = {layer: local for local, layer in enumerate(layer_ids)}
            entries.append(hc.build_pool_entry(name=name, host_pool=host, device_pool=device_pool,
                                               layer_mapping=mapping, transfer_layer_id_max=layers,
                                               is_anchor=name == hc.PoolName.KV))
            self.views[space] = HostFreeListView(space=space, host_pool=host, layer_ids=layer_ids,
                                                 latent_width=config.kv_lora_rank if config.latent else None)
        self.group = hc.HostPoolGroup(entries)
        self.controller = hc.HybridCacheController(
            allocator, self.group, config.page_size, tp_group=None, load_cache_event=threading.Event(),
            io_backend=self.io_backend, transfer_layer_id_max=layers)
        self.tree = self._standin_tree()

    def _host_pool(self, device_pool):
        """The host pool SGLang's ``build_kv_host_pool`` picks for this device pool, sized by the config."""
        info = device_pool.get_device_pool_infos()[0].buffer_info
        common = dict(pin_memory=False, device="cpu", allocator_type="default", device_capacity_tokens=device_pool.size,
                      start_layer=device_pool.start_layer, end_layer=device_pool.end_layer,
                      host_token_capacity=self.config.host_size)
        if self.config.latent:
            return self.hc.mla.MLATokenToKVPoolHost(
                info, 0.0, 0, self.config.page_size, HOST_LAYOUT, override_kv_cache_dim=device_pool.kv_cache_dim,
                target_layer_num=device_pool.layer_num, **common)
        cls = self.hc.mha.get_mha_host_pool_cls(info)
        return cls(info, 0.0, 0, self.config.page_size, HOST_LAYOUT, **common)

    def _standin_tree(self):
        """The ``UnifiedRadixCache`` fields the retraction methods read; it caches no prefix."""
        c = self.config
        tree = types.SimpleNamespace(
            req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator, page_size=c.page_size,
            sliding_window_size=c.sliding_window if c.has_swa else None, sidecar_pool_specs=[],
            cache_controller=self.controller, host_pool_group=self.group, disable=False)
        tree.supports_swa = lambda: c.has_swa
        tree.evict_host = lambda num_tokens: 0  # no HiCache prefix is cached on the host: nothing to reclaim
        setattr(tree, private_name("pad_retraction_indices"), private("pad_retraction_indices"))
        for name in TREE_METHODS:
            setattr(tree, name, types.MethodType(getattr(self.hc.UnifiedRadixCache, name), tree))
        return tree

    # --- the three calls of the scheduler ------------------------------------------------------
    def backup(self, sg, num_tokens: int) -> RetractionBackup:
        """``backup_kv_cache(..., "host_pool")`` while the request still holds its slots. False (the host
        pool is full even after reclaiming) is SGLang's abort: raised as PoolExhausted before any release."""
        ok = self.hc.common.backup_kv_cache(sg, self.tree, self.req_pool, self.allocator, "host_pool")
        if not ok:
            short = self._short_space(num_tokens)
            raise PoolExhausted(space=short, requested=num_tokens, available=self.views[short].available_size())
        return self.record(sg, num_tokens)

    def record(self, sg, num_tokens: int) -> RetractionBackup:
        """The harness's record of SGLang's backup: which host slots hold which positions."""
        backup = sg.kv.retraction_backup
        if backup is None:  # seqlen <= 1: nothing to keep
            return RetractionBackup(mode="host_pool", num_tokens=num_tokens)
        transfers = [HostTransfer(space="host.full", host_indices=backup.host_indices.to(torch.int64),
                                  first_position=0, num_tokens=num_tokens)]
        for t in backup.pool_transfers or []:
            if t.name == self.hc.PoolName.SWA:
                first = window_start(self.config, num_tokens)
                transfers.append(HostTransfer(space="host.swa", host_indices=t.host_indices.to(torch.int64),
                                              first_position=first, num_tokens=num_tokens - first))
        return RetractionBackup(mode="host_pool", num_tokens=num_tokens, host_transfers=tuple(transfers))

    def _short_space(self, num_tokens: int) -> str:
        ps = self.config.page_size
        if self.views["host.full"].available_size() < -(-num_tokens // ps) * ps or "host.swa" not in self.views:
            return "host.full"
        return "host.swa"

    def restore(self, sg) -> None:
        self.hc.common.restore_kv_cache(sg, self.tree, self.req_pool, self.allocator, "host_pool")

    def discard(self, sg) -> None:
        self.hc.common.discard_kv_cache_backup(sg, self.tree, "host_pool")
