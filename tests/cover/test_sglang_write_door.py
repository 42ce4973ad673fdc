"""The SGLang adapter's write door on a release without ``KVWriteLoc``: the SWA translation goes in as
``swa_loc=`` where ``set_kv_buffer`` takes it (0.5.13 asserts it is given), and nowhere else."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.adapters.sglang.pools import writes


class _Pool:
    """A stand-in with the 0.5.13 door: a bare full loc, the SWA slots only as ``swa_loc``."""

    dtype = torch.float32

    def __init__(self):
        self.calls = []

    def translate_loc_from_full_to_swa(self, loc):
        return loc + 100

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=1.0, v_scale=1.0, swa_loc=None):
        self.calls.append((layer.layer_id, loc.tolist(), None if swa_loc is None else swa_loc.tolist()))


class _OldPool(_Pool):
    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=1.0, v_scale=1.0):  # no swa_loc at all
        self.calls.append((layer.layer_id, loc.tolist(), None))


@pytest.fixture
def no_write_loc(monkeypatch):
    real = writes.first_importable
    monkeypatch.setattr(writes, "first_importable",
                        lambda *c, required=True: None if "KVWriteLoc" in c[0] else real(*c, required=required))


@pytest.mark.parametrize("pool_cls, expected_swa", [(_Pool, [101, 102]), (_OldPool, None)])
def test_the_swa_translation_goes_in_where_the_door_takes_it(no_write_loc, pool_cls, expected_swa):
    pool = pool_cls()
    rows = {("swa.k", 1): torch.ones(2, 1, 4), ("swa.v", 1): torch.ones(2, 1, 4)}
    done = writes.write_rows(pool, mha_layers=[("swa", 1)], mla_layers=[], slots=torch.tensor([1, 2]), rows=rows)
    assert done == set(rows)
    assert pool.calls == [(1, [1, 2], expected_swa)]
