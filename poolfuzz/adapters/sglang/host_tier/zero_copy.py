"""A CPU stand-in for HiCache's zero-copy L3 backends (Mooncake, HF3FS, ...), loaded by SGLang as a
``dynamic`` storage backend with ``interface_v1``.

With such a backend SGLang's controller moves pages with ``batch_set_v1`` / ``batch_get_v1`` over host
indices (``_page_set_zero_copy`` / ``_page_get_zero_copy``), and the backend asks the host pool where
each page's bytes are: ``get_page_buffer_meta(host_indices)``, one (address, size) per object of a page
(per layer K and V on a layer-first host, K and V of the whole page on a page-first one; one object per
page for MLA). The real backends hand those addresses to an RDMA or file engine; this one copies the
bytes itself, from and to the host pool buffers the adapter registered (``kernel_io.REGISTRY``; the host
pools live in shared memory, SGLang's ``"allocator": "shm"`` for a dynamic backend, as an engine in another
process reads them), and an
address outside them, or a size past a buffer's end, raises ``IllegalAddress``, as the engine's DMA
would fault. Everything that decides the addresses (the pool's layout arithmetic, the controller's
batching) is SGLang's. The objects live in memory, one store per tree, gone with it.

The class is built on first use (``ZeroCopyStore``, read by SGLang's factory by name), so that importing
this module needs no SGLang.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

from poolfuzz.adapters.sglang.host_tier.kernel_io import REGISTRY, IllegalAddress

BACKEND = "dynamic"
CLASS_NAME = "ZeroCopyStore"


HEAD_SPLIT = 2  # ``tp_lcm_size`` on a page-head host: pages stored as a two-rank decode server reads them


def extra_config(*, layout: str, head_num: int) -> dict:
    """``--hicache-storage-backend-extra-config`` naming this backend to SGLang's factory. On a ``page_head``
    host (the layout for storage shared by servers of different TP sizes) it also sets ``tp_lcm_size``: the
    pages are then stored split by heads, each part an object of its own, as a backend writes them for a
    decode server with twice this one's TP (``get_split_heads_page_buffer_meta``)."""
    out = {"backend_name": "poolfuzz-zero-copy", "module_path": __name__, "class_name": CLASS_NAME,
           "interface_v1": 1, "allocator": "shm"}
    if layout == "page_head" and head_num % HEAD_SPLIT == 0:
        out["tp_lcm_size"] = HEAD_SPLIT
    return out


def _bytes_at(address: int, size: int, what: str) -> torch.Tensor:
    """The ``size`` bytes at ``address``, inside one registered buffer (a view, not a copy)."""
    buf, offset = REGISTRY.resolve(address, size, what)
    if offset + size > buf.numel():
        raise IllegalAddress(f"zero-copy stand-in: {what} of {size} bytes at {address:#x} runs "
                             f"{offset + size - buf.numel()} bytes past the end of its buffer")
    return buf[offset:offset + size]


@lru_cache(maxsize=1)
def _store_class():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class ZeroCopyStore(HiCacheStorage):
        """Objects by key, each page's list of byte chunks in ``get_page_buffer_meta``'s order."""

        def __init__(self, storage_config=None, kwargs=None):
            self.objects: dict[str, list[torch.Tensor]] = {}
            split = getattr(storage_config, "should_split_heads", False)
            self.split_factor = storage_config.tp_lcm_size // storage_config.tp_size if split else 1
            # What a DMA engine would have faulted on. A GPU's illegal access kills the process, so the
            # adapter raises these after each poll (``l3.settle``); SGLang's storage thread is told that no
            # page of the batch moved, not handed the exception: 0.5.22 on logs a backend's exception and goes
            # on, but 0.5.21's threads die of it, and the poll then waits for ever on the batch they never ack.
            self.faults: list[IllegalAddress] = []
            self._scratch = None  # (host pool, its scratch copy): see _scratch_for

        def _guarded(self, io, keys, host_indices):
            try:
                return io(keys, host_indices)
            except IllegalAddress as exc:
                self.faults.append(exc)
                return [False] * len(keys)

        def _meta(self, keys, host_indices):
            host = self.mem_pool_host
            if self.split_factor > 1:
                ptrs, sizes = host.get_split_heads_page_buffer_meta(host_indices, self.split_factor)
            else:
                ptrs, sizes = host.get_page_buffer_meta(host_indices)
            if len(ptrs) % max(len(keys), 1) or len(ptrs) != len(sizes):
                raise IllegalAddress(f"zero-copy stand-in: {len(ptrs)} addresses and {len(sizes)} sizes for "
                                     f"{len(keys)} pages")
            per = len(ptrs) // max(len(keys), 1)
            return [(list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))) for i in range(len(keys))]

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            return self._guarded(self._set, keys, host_indices)

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            return self._guarded(self._get, keys, host_indices)

        def _set(self, keys, host_indices):
            for key, chunks in zip(keys, self._meta(keys, host_indices)):
                if key not in self.objects:  # a stored page is not written again (as every backend does)
                    self.objects[key] = [_bytes_at(p, s, f"page {key[:12]} read").clone() for p, s in chunks]
            return [True] * len(keys)

        def _get(self, keys, host_indices):
            out = []
            for key, chunks in zip(keys, self._meta(keys, host_indices)):
                stored = self.objects.get(key)
                if stored is None or [c.numel() for c in stored] != [s for _, s in chunks]:
                    out.append(False)
                    continue
                for (p, s), data in zip(chunks, stored):
                    _bytes_at(p, s, f"page {key[:12]} write").copy_(data)
                out.append(True)
            return out

        def exists(self, key) -> bool:
            return key in self.objects

        def batch_exists(self, keys, extra_info=None) -> int:
            for i, key in enumerate(keys):
                if key not in self.objects:
                    return i
            return len(keys)

        # the generic (copying) interface, which a zero-copy backend is never asked for
        def get(self, key, target_location=None, target_sizes=None):
            return None

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            return [None] * len(keys)

        def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
            return False

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
            return False

        def clear(self) -> bool:
            self.objects.clear()
            return True

        def flat_page(self, key: str, host) -> torch.Tensor:
            """The page stored under ``key`` as the host pool's ``get_data_page`` lays one out (what the
            checks read): its chunks written into a scratch copy of the host buffer where the pool's own
            meta puts its first page, and that page read back by the pool's ``get_data_page``."""
            scratch = self._scratch_for(host)
            base = host.kv_buffer.data_ptr()
            flat = scratch.kv_buffer.view(-1).view(torch.uint8)
            chunks = self._meta([key], torch.arange(host.page_size))[0]
            for (p, s), data in zip(chunks, self.objects[key]):
                flat[p - base:p - base + s] = data  # the same chunks for every page: nothing stale is left
            # a copy: a view would keep the whole scratch buffer alive with every page the checks hold
            return scratch.get_data_page(0).clone()

        def _scratch_for(self, host):
            """One scratch copy of the host pool per store: a fresh one per page read cost a host buffer
            each (a 20480-token prompt's audit asked for 300 GB)."""
            scratch = self._scratch
            if scratch is None or scratch[0] is not host:
                copied = copy.copy(host)
                copied.kv_buffer = torch.zeros_like(host.kv_buffer)
                scratch = self._scratch = (host, copied)
            return scratch[1]

    ZeroCopyStore.__name__ = ZeroCopyStore.__qualname__ = CLASS_NAME
    return ZeroCopyStore


def __getattr__(name: str):
    if name == CLASS_NAME:
        return _store_class()
    raise AttributeError(name)
