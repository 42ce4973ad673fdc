"""Catalogue faults planted in the host (CPU) pools of host_pool retraction backup."""

from __future__ import annotations

from poolfuzz.pools.allocator import _as_index
from poolfuzz.pools.host import HostKVPool


class HostLoadStopsAtPoolLayerCount(HostKVPool):
    """Loads a backup back layer by layer over model layer ids below the host pool's own layer count,
    not the model's (HiCache's layer-wise load runs ``range(transfer_layer_id_max)``, which must be the
    model's max layer id + 1): right when the pool's layers are the model's first ones, but where
    attention layers interleave (an SWA model's side pool holds layers 1 and 2 of 3), the pool's higher
    layers are never loaded and keep whatever the reused device slots held."""

    def load_to_device(self, device_pool, host_idx, dev_idx):
        h, d = _as_index(host_idx), _as_index(dev_idx).to(device_pool.device)
        for local, layer_id in enumerate(self.layer_ids):
            if layer_id >= len(self.layer_ids):  # the wrong bound: the pool's layer count
                continue
            device_pool.k_buffer[local][d] = self.k[local, h].to(device_pool.device)
            device_pool.v_buffer[local][d] = self.v[local, h].to(device_pool.device)
