"""The CPU stand-ins for the ``kernel`` I/O backend copy the bytes sgl-kernel's offsets name (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.adapters.sglang.host_tier import kernel_io as k

LAYERS, SLOTS, HEADS, DIM = 3, 8, 2, 4


def _device():
    """Layer-first device K and V: ``[slots, heads, dim]`` per layer, each value naming (kv, layer, slot)."""
    def layer(kv, l):
        return (torch.arange(SLOTS * HEADS * DIM, dtype=torch.float32).reshape(SLOTS, HEADS, DIM)
                + 1000 * l + 10000 * kv)
    return [layer(0, l) for l in range(LAYERS)], [layer(1, l) for l in range(LAYERS)]


def _table(tensors):
    k.register_buffers(list(tensors))
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


ITEM = HEADS * DIM * 4  # bytes of one token's row in one layer


def test_page_first_write_back_then_load_back_round_trips_every_layer():
    dev_k, dev_v = _device()
    host = torch.zeros(2, SLOTS, LAYERS, HEADS, DIM)  # page_first: [kv, slot, layer, ...]
    src, dst = torch.tensor([5, 1, 6]), torch.tensor([0, 7, 3])
    k.transfer_kv_all_layer_lf_pf(_table(dev_k), host[0], _table(dev_v), host[1], src, dst, ITEM, ITEM * LAYERS,
                                  LAYERS)
    for l in range(LAYERS):
        assert torch.equal(host[0][dst, l], dev_k[l][src]) and torch.equal(host[1][dst, l], dev_v[l][src])
    assert not host[:, [1, 2, 4, 5, 6]].any()  # untouched host slots
    out_k, out_v = [torch.zeros_like(t) for t in dev_k], [torch.zeros_like(t) for t in dev_v]
    for l in range(LAYERS):
        k.transfer_kv_per_layer_pf_lf(host[0], out_k[l], host[1], out_v[l], dst, src, l, ITEM, ITEM * LAYERS)
        assert torch.equal(out_k[l][src], dev_k[l][src]) and torch.equal(out_v[l][src], dev_v[l][src])


def test_page_head_write_back_then_load_back_round_trips_every_head():
    ps = 2
    dev_k, dev_v = _device()
    host = torch.zeros(2, SLOTS // ps, HEADS, ps, LAYERS, DIM)  # page_head: [kv, page, head, ps, layer, dim]
    src, dst = torch.tensor([2, 3, 6, 7]), torch.tensor([4, 5, 0, 1])
    k.transfer_kv_all_layer_lf_ph(_table(dev_k), host[0], _table(dev_v), host[1], src, dst, ITEM, ITEM * LAYERS,
                                  LAYERS, ps, HEADS)
    for l in range(LAYERS):
        for h in range(HEADS):
            assert torch.equal(host[0][dst // ps, h, dst % ps, l], dev_k[l][src, h])
    out_k, out_v = torch.zeros_like(dev_k[1]), torch.zeros_like(dev_v[1])
    k.transfer_kv_per_layer_ph_lf(host[0], out_k, host[1], out_v, dst, src, 1, ITEM, ITEM * LAYERS, ps, HEADS)
    assert torch.equal(out_k[src], dev_k[1][src]) and torch.equal(out_v[src], dev_v[1][src])


def test_layer_first_all_layer_and_mla_tables_copy_rows():
    dev_k, dev_v = _device()
    host_k, host_v = [torch.zeros_like(t) for t in dev_k], [torch.zeros_like(t) for t in dev_v]
    src, dst = torch.tensor([0, 4]), torch.tensor([6, 2])
    k.transfer_kv_all_layer(_table(dev_k), _table(host_k), _table(dev_v), _table(host_v), src, dst, ITEM, LAYERS)
    for l in range(LAYERS):
        assert torch.equal(host_k[l][dst], dev_k[l][src]) and torch.equal(host_v[l][dst], dev_v[l][src])
    latent = torch.zeros_like(dev_k[0])
    k.transfer_kv_all_layer_mla(_table(dev_k[2:]), _table([latent]), src, dst, ITEM, 1)
    assert torch.equal(latent[dst], dev_k[2][src])


def test_an_address_outside_every_registered_buffer_is_an_illegal_access():
    dev_k, _ = _device()
    stray = torch.zeros(4)  # never registered
    table = torch.tensor([stray.data_ptr()], dtype=torch.uint64)
    host = torch.zeros(SLOTS, 1, HEADS, DIM)
    with pytest.raises(k.IllegalAddress, match="no registered"):
        k.transfer_kv_all_layer_mla_lf_pf(table, host, torch.tensor([0]), torch.tensor([0]), ITEM, ITEM, 1)
    with pytest.raises(k.IllegalAddress, match="outside its buffer"):  # a stride past the end of the host buffer
        k.transfer_kv_per_layer_mla_pf_lf(host, dev_k[0], torch.tensor([SLOTS]), torch.tensor([0]), 0, ITEM, ITEM)


def test_ops_are_given_only_where_a_module_lacks_them(monkeypatch):
    import sys
    import types

    from poolfuzz.adapters.sglang.shims import _CallRaises

    module = types.ModuleType("fake")
    real = object()
    module.transfer_kv_per_layer = real
    # what 0.5.12's host pool module holds on a machine without sgl_kernel: the import-only stand-in's name
    module.transfer_kv_per_layer_mla = _CallRaises("sgl_kernel.kvcacheio.transfer_kv_per_layer_mla")
    monkeypatch.setattr(k, "HOST_POOL_MODULES", ("fake",))
    monkeypatch.setitem(sys.modules, "fake", module)
    done = k.install_cpu_kernel_ops()
    assert module.transfer_kv_per_layer is real and "fake.transfer_kv_per_layer" not in done
    assert module.transfer_kv_all_layer is k.transfer_kv_all_layer
    assert module.transfer_kv_per_layer_mla is k.transfer_kv_per_layer_mla and "fake.transfer_kv_per_layer_mla" in done


def test_an_address_resolves_to_its_own_buffer_among_many():
    registry = k._Registry()
    buffers = [torch.full((64,), i % 256, dtype=torch.uint8) for i in range(300)]
    for b in buffers:
        registry.add(b)
    for i in (0, 7, 150, 299):
        data, offset = registry.resolve(buffers[i].data_ptr() + 5, 1, "probe")
        assert offset == 5 and int(data[offset]) == i % 256 and data.numel() == 64
    with pytest.raises(k.IllegalAddress):  # one byte past the end of the highest buffer
        top = max(buffers, key=lambda b: b.data_ptr())
        registry.resolve(top.data_ptr() + 64, 1, "probe")


def test_a_freed_buffer_is_no_longer_addressable_and_leaves_the_registry():
    registry = k._Registry()
    kept, freed = torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    registry.add(kept)
    registry.add(freed)
    address = freed.data_ptr()
    del freed
    with pytest.raises(k.IllegalAddress):
        registry.resolve(address, 1, "probe")
    assert list(registry.spans) == [kept.data_ptr()] == registry._bases
    assert registry.resolve(kept.data_ptr() + 31, 1, "probe")[1] == 31


def test_resolving_looks_at_one_buffer_however_many_are_registered():
    """A lookup dereferences the one buffer below the address (a storage copy makes one per page chunk: a
    scan of every registered buffer made a long session's copies slower with every pool it had built)."""
    registry = k._Registry()
    buffers = [torch.zeros(16, dtype=torch.uint8) for _ in range(2000)]
    for b in buffers:
        registry.add(b)
    looked = []

    class Counted:
        def __init__(self, base, ref):
            self.base, self.ref = base, ref

        def __call__(self):
            looked.append(self.base)
            return self.ref()

    registry.spans = {base: (size, Counted(base, ref)) for base, (size, ref) in registry.spans.items()}
    target = buffers[1234].data_ptr()
    assert registry.resolve(target + 3, 1, "probe")[1] == 3
    assert looked == [target]
