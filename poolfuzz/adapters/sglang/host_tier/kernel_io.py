"""The ``kernel`` I/O backend's copies on the CPU: byte copies at the addresses sgl-kernel's kernels compute.

With ``--hicache-io-backend kernel`` SGLang's host pools move KV through ``sgl_kernel.kvcacheio``'s CUDA
kernels (and, for mamba state, SGLang's JIT ``transfer_kv_mamba_*``). They take raw addresses: one
tensor base, or a table of per-layer base pointers (``make_kernel_ptr_table``), and for every
(index, layer) they copy ``item_size`` bytes between two offsets the caller's strides define
(``sgl-kernel/csrc/kvcacheio/transfer.cu``: ``get_global_offset_lf`` / ``_lf_tbl`` / ``_pf`` / ``_ph``).
Those modules import them only under CUDA/ROCm; where they are missing (a CPU-only machine),
:func:`install_cpu_kernel_ops` gives the host pool modules stand-ins that do what the kernels do, at
the same offsets, so every stride, item size and layer id SGLang's pool hands the kernel is used as
the GPU would use it. A wrong one moves the wrong bytes, which the checksums then see.

An address is resolved against the buffers registered with :func:`register_buffers` (the host and
device pools of a HiCache tree): one outside all of them is the GPU's illegal memory access, raised
as :class:`IllegalAddress` instead of writing anywhere. SGLang's own kernels are never replaced
where they exist.
"""

from __future__ import annotations

import bisect
import importlib
import weakref

import torch

from poolfuzz.adapters.sglang.illegal_address import IllegalAddress

# The modules SGLang's host pool classes live in (``pool_host.<kind>`` on the releases that have them; one
# ``memory_pool_host`` before), each calling the copies by the name it imported them under.
HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla",
                     "sglang.srt.mem_cache.pool_host.mamba", "sglang.srt.mem_cache.memory_pool_host")


class _Registry:
    """The CPU buffers (whole storages) a kernel may address, held weakly: a pool that is gone is no
    longer addressable, and its memory is not kept alive by the registry. Kept sorted by base address, so
    an address is found in as many steps as the log of the buffers registered: a storage copy resolves
    every page's every chunk, and with one scan of all the buffers a long process's copies slowed as it
    went, past the storage threads' deadline (``l3.settle``)."""

    def __init__(self):
        self.spans: dict[int, tuple[int, weakref.ref]] = {}  # storage base address -> (bytes, its tensor)
        self._bases: list[int] = []  # the keys of ``spans``, ascending

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.nbytes():
            base = storage.data_ptr()
            if base not in self.spans:
                bisect.insort(self._bases, base)
            self.spans[base] = (storage.nbytes(), weakref.ref(tensor))

    def _forget(self, base: int) -> None:
        del self.spans[base]
        del self._bases[bisect.bisect_left(self._bases, base)]

    def resolve(self, address: int, nbytes: int, what: str) -> tuple[torch.Tensor, int]:
        """(the bytes of the buffer holding ``address``, the offset of ``address`` in it)."""
        while True:
            at = bisect.bisect_right(self._bases, address) - 1  # the buffer starting at or below the address
            if at < 0:
                break
            base = self._bases[at]
            size, ref = self.spans[base]
            tensor = ref()
            if tensor is None or tensor.untyped_storage().data_ptr() != base:
                self._forget(base)  # freed: its address may belong to a new buffer now (look again without it)
                continue
            if address < base + size:
                return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()), address - base
            break
        raise IllegalAddress(f"kernel stand-in: {what} address {address:#x} ({nbytes} bytes) is in no registered "
                             "host or device pool buffer (an illegal memory access on the GPU)")


REGISTRY = _Registry()


def register_buffers(*owners) -> None:
    """Register every CPU tensor the given pools hold (attributes, lists of tensors, buffer infos)."""
    seen: set[int] = set()

    def walk(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            REGISTRY.add(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth)
        elif depth > 0 and hasattr(value, "__dict__") and type(value).__module__.startswith("sglang"):
            if id(value) in seen:
                return
            seen.add(id(value))
            for item in vars(value).values():
                walk(item, depth - 1)

    for owner in owners:
        walk(owner, 3)


def _tensor_base(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return data, t.data_ptr() - t.untyped_storage().data_ptr()


def _copy(src: tuple[torch.Tensor, int], dst: tuple[torch.Tensor, int], src_off: torch.Tensor,
          dst_off: torch.Tensor, nbytes: int, what: str) -> None:
    """``nbytes`` at each of ``src_off`` (bytes from the source base) to the matching ``dst_off``."""
    if src_off.numel() == 0 or nbytes <= 0:
        return
    span = torch.arange(nbytes, dtype=torch.int64)
    (s_data, s_base), (d_data, d_base) = src, dst
    s = (s_base + src_off.to(torch.int64).reshape(-1, 1) + span).reshape(-1)
    d = (d_base + dst_off.to(torch.int64).reshape(-1, 1) + span).reshape(-1)
    for data, idx, side in ((s_data, s, "source"), (d_data, d, "destination")):
        if int(idx.min()) < 0 or int(idx.max()) >= data.numel():
            raise IllegalAddress(f"kernel stand-in {what}: {side} bytes [{int(idx.min())}, {int(idx.max())}] "
                                 f"outside its buffer of {data.numel()} (an illegal memory access on the GPU)")
    d_data[d] = s_data[s]


def _table(ptrs: torch.Tensor, layer: int, nbytes: int, what: str) -> tuple[torch.Tensor, int]:
    return REGISTRY.resolve(int(ptrs[layer].item()), nbytes, what)


def _idx(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(torch.int64).cpu().reshape(-1)


def _check_pairs(src_indices, dst_indices, what):
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{what}: {src_indices.numel()} source indices, {dst_indices.numel()} destination")


# --- MHA: K and V -------------------------------------------------------------------------------
def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, **_):
    """One layer, layer-first both sides: row ``i`` at ``base + i * item_size``."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_per_layer")
    s, d = _idx(src_indices) * item_size, _idx(dst_indices) * item_size
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_tensor_base(src), _tensor_base(dst), s, d, item_size, "transfer_kv_per_layer")


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers, **_):
    """Every layer, both sides per-layer pointer tables."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_all_layer")
    s, d = _idx(src_indices) * item_size, _idx(dst_indices) * item_size
    for layer in range(num_layers):
        for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
            _copy(_table(src, layer, item_size, "source"), _table(dst, layer, item_size, "destination"), s, d,
                  item_size, "transfer_kv_all_layer")


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, **_):
    """Page-first host (``i * layout_dim + layer * item_size``) into one layer-first device layer."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_per_layer_pf_lf")
    s = _idx(src_indices) * src_layout_dim + layer_id * item_size
    d = _idx(dst_indices) * item_size
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_tensor_base(src), _tensor_base(dst), s, d, item_size, "transfer_kv_per_layer_pf_lf")


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, **_):
    """Every layer-first device layer (pointer table) into the page-first host buffer."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_all_layer_lf_pf")
    s, di = _idx(src_indices) * item_size, _idx(dst_indices) * dst_layout_dim
    for layer in range(num_layers):
        for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
            _copy(_table(src, layer, item_size, "source"), _tensor_base(dst), s, di + layer * item_size,
                  item_size, "transfer_kv_all_layer_lf_pf")


def _page_head_offsets(indices, layer, head, item_size, layout_dim, page_size, head_num):
    """``get_global_offset_ph``: host ``[page, head, page_size, layer, head_dim]``."""
    return (indices // page_size * page_size * layout_dim + layout_dim // head_num * head * page_size
            + indices % page_size * layout_dim // head_num + layer * item_size // head_num)


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, page_size, head_num, **_):
    """Page-head host into one layer-first device layer, head by head."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_per_layer_ph_lf")
    si, di, head_bytes = _idx(src_indices), _idx(dst_indices), item_size // head_num
    for head in range(head_num):
        s = _page_head_offsets(si, layer_id, head, item_size, src_layout_dim, page_size, head_num)
        d = di * item_size + head_bytes * head
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            _copy(_tensor_base(src), _tensor_base(dst), s, d, head_bytes, "transfer_kv_per_layer_ph_lf")


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, page_size, head_num, **_):
    """Every layer-first device layer (pointer table) into the page-head host buffer, head by head."""
    _check_pairs(src_indices, dst_indices, "transfer_kv_all_layer_lf_ph")
    si, di, head_bytes = _idx(src_indices), _idx(dst_indices), item_size // head_num
    for layer in range(num_layers):
        for head in range(head_num):
            s = si * item_size + head_bytes * head
            d = _page_head_offsets(di, layer, head, item_size, dst_layout_dim, page_size, head_num)
            for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
                _copy(_table(src, layer, item_size, "source"), _tensor_base(dst), s, d, head_bytes,
                      "transfer_kv_all_layer_lf_ph")


# --- MLA (and mamba state, which reuses the single-buffer ops): one buffer ------------------------
def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, **_):
    _check_pairs(src_indices, dst_indices, "transfer_kv_per_layer_mla")
    _copy(_tensor_base(src), _tensor_base(dst), _idx(src_indices) * item_size, _idx(dst_indices) * item_size,
          item_size, "transfer_kv_per_layer_mla")


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_):
    _check_pairs(src_indices, dst_indices, "transfer_kv_all_layer_mla")
    s, d = _idx(src_indices) * item_size, _idx(dst_indices) * item_size
    for layer in range(num_layers):
        _copy(_table(src_layers, layer, item_size, "source"), _table(dst_layers, layer, item_size, "destination"),
              s, d, item_size, "transfer_kv_all_layer_mla")


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
    _check_pairs(src_indices, dst_indices, "transfer_kv_per_layer_mla_pf_lf")
    _copy(_tensor_base(src), _tensor_base(dst), _idx(src_indices) * src_layout_dim + layer_id * item_size,
          _idx(dst_indices) * item_size, item_size, "transfer_kv_per_layer_mla_pf_lf")


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                                    num_layers, **_):
    _check_pairs(src_indices, dst_indices, "transfer_kv_all_layer_mla_lf_pf")
    s, di = _idx(src_indices) * item_size, _idx(dst_indices) * dst_layout_dim
    for layer in range(num_layers):
        _copy(_table(src_layers, layer, item_size, "source"), _tensor_base(dst), s, di + layer * item_size,
              item_size, "transfer_kv_all_layer_mla_lf_pf")


# SGLang's mamba JIT kernels have the single-buffer page-first contracts.
def transfer_kv_mamba_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
    transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim)


def transfer_kv_mamba_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_):
    transfer_kv_all_layer_mla_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers)


CPU_KERNEL_OPS = {f.__name__: f for f in (
    transfer_kv_per_layer, transfer_kv_all_layer, transfer_kv_per_layer_pf_lf, transfer_kv_all_layer_lf_pf,
    transfer_kv_per_layer_ph_lf, transfer_kv_all_layer_lf_ph, transfer_kv_per_layer_mla, transfer_kv_all_layer_mla,
    transfer_kv_per_layer_mla_pf_lf, transfer_kv_all_layer_mla_lf_pf, transfer_kv_mamba_pf_lf,
    transfer_kv_mamba_lf_pf)}


def install_cpu_kernel_ops() -> list[str]:
    """Give the host pool modules the ``kernel`` copies where their CUDA-only import left them out."""
    return install_missing_copies(CPU_KERNEL_OPS)


def host_pool_modules() -> list[tuple[str, object]]:
    """``(name, module)`` of each host pool module this release has and that imports here."""
    found = []
    for name in HOST_POOL_MODULES:
        try:
            found.append((name, importlib.import_module(name)))
        except Exception:  # not in this release, or not importable here
            continue
    return found


def install_missing_copies(copies: dict) -> list[str]:
    """Give each host pool module the CPU ``copies`` (name -> function) it lacks: where its CUDA-only import left
    the name unset, or bound it to the import-only ``sgl_kernel`` stand-in (0.5.12 imports ``sgl_kernel.kvcacheio``
    on every non-NPU machine), whose call would raise. A real kernel is never replaced. Returns what was given."""
    from poolfuzz.adapters.sglang.shims import import_only

    done = []
    for name, module in host_pool_modules():
        for op, cpu_op in copies.items():
            current = getattr(module, op, None)
            if current is None or import_only(current):
                setattr(module, op, cpu_op)
                done.append(f"{name}.{op}")
    return done
