"""Catalogue faults planted in the host (CPU) pools of host_pool retraction backup."""

from __future__ import annotations

from poolfuzz.pools.allocator import as_index
from poolfuzz.pools.components import zeros
from poolfuzz.pools.host import HostKVPool


class HostLoadStopsAtPoolLayerCount(HostKVPool):
    """Loads a backup back layer by layer over model layer ids below the host pool's own layer count,
    not the model's (HiCache's layer-wise load runs ``range(transfer_layer_id_max)``, which must be the
    model's max layer id + 1): right when the pool's layers are the model's first ones, but where
    attention layers interleave (an SWA model's side pool holds layers 1 and 2 of 3), the pool's higher
    layers are never loaded and keep whatever the reused device slots held."""

    def load_to_device(self, device_pool, host_idx, dev_idx):
        h, d = as_index(host_idx), as_index(dev_idx).to(device_pool.device)
        for local, layer_id in enumerate(self.layer_ids):
            if layer_id >= len(self.layer_ids):  # the wrong bound: the pool's layer count
                continue
            device_pool.k_buffer[local][d] = self.k[local, h].to(device_pool.device)
            device_pool.v_buffer[local][d] = self.v[local, h].to(device_pool.device)


class HostPageStrideOmitsALayer(HostKVPool):
    """A page-first host pool (HiCache's ``page_first`` layout, ``[slot, layer, heads, head_dim]``) whose
    copies step from one host slot to the next by one layer too few (``layout_dim`` of ``layers - 1``
    rows, as the ``kernel`` backend's page-first copies are handed it): a slot's top layer lands on the
    next slot's first layer, so a backup of two or more tokens overwrites its own neighbour and the
    resume loads another position's KV."""

    def __init__(self, *, device_pool, size: int, page_size: int, space: str):
        super().__init__(device_pool=device_pool, size=size, page_size=page_size, space=space)
        layers = len(self.layer_ids)
        rest = tuple(self.k.shape[2:])
        # Page-first storage; ``k`` / ``v`` (what the checks read) are its per-layer views.
        self.k_pages = zeros((size, layers, *rest), dtype=self.k.dtype)
        self.v_pages = zeros((size, layers, *rest), dtype=self.v.dtype)
        self.k, self.v = self.k_pages.transpose(0, 1), self.v_pages.transpose(0, 1)

    def _rows(self, host_idx, local: int):
        """Flat row numbers of ``(slot, layer)`` with the short stride (the right one is ``layers``)."""
        return host_idx * (len(self.layer_ids) - 1) + local

    def backup_from_device(self, device_pool, host_idx, dev_idx) -> None:
        h, d = as_index(host_idx), as_index(dev_idx).to(device_pool.device)
        for local in range(len(self.layer_ids)):
            rows = self._rows(h, local)
            self.k_pages.view(-1, *self.k_pages.shape[2:])[rows] = device_pool.k_buffer[local][d].to("cpu")
            self.v_pages.view(-1, *self.v_pages.shape[2:])[rows] = device_pool.v_buffer[local][d].to("cpu")

    def load_to_device(self, device_pool, host_idx, dev_idx) -> None:
        h, d = as_index(host_idx), as_index(dev_idx).to(device_pool.device)
        for local in range(len(self.layer_ids)):
            rows = self._rows(h, local)
            device_pool.k_buffer[local][d] = self.k_pages.view(-1, *self.k_pages.shape[2:])[rows].to(device_pool.device)
            device_pool.v_buffer[local][d] = self.v_pages.view(-1, *self.v_pages.shape[2:])[rows].to(device_pool.device)
