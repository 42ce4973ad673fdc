"""The free patterns SGLang's callers make, driven through the installed release's own calls:
free groups around eviction and release, row segments, the mamba slot group of a scheduling pass,
and an abort between two prefill chunks, at page sizes 1 and 4."""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.request import ReqKv
from tests.sglang.families import family_or_skip as _family

CONFIGS_BOTH = ["dense", "dense-ps4", "swa", "swa-ps4", "hybrid-linear", "hybrid-linear-ps4", "swa-ssm", "swa-ssm-ps4"]


class _Spy:
    """Records the calls made to some methods of an object, and still makes them."""

    def __init__(self, obj, *names):
        self.calls: list[str] = []
        for name in names:
            original = getattr(obj, name, None)
            if original is not None:
                setattr(obj, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return call


@pytest.mark.parametrize("name", CONFIGS_BOTH)
def test_an_abort_between_prefill_chunks_gives_everything_back(api, name):
    """Chunks of 3 and 2 tokens: the row ends mid-page at page size 4; SGLang's release frees it all."""
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.harness.engine import Engine, Phase

    _family(api, name)
    engine = Engine(config=CONFIGS[name], family_factory=build_family)
    rid = engine.admit(12)
    for chunk in (3, 2):
        assert engine.prefill(rid, chunk)
        engine.check()
    assert engine.requests[rid].phase is Phase.PREFILLING
    engine.abort(rid)
    engine.check()
    engine.drain()


@pytest.mark.parametrize("name", ["dense-ps4", "swa-ps4", "hybrid-linear"])
def test_a_finish_frees_its_row_by_segments_inside_a_free_group(api, name):
    fam = _family(api, name)
    alloc = fam.sg_allocator
    from poolfuzz.adapters.sglang.lifecycle.frees import row_segments_supported

    if not row_segments_supported(fam):  # 0.5.18 has free_segments but no free_kv_row_segments
        pytest.skip(f"sglang {api.version} frees rows whole")
    before = {s: v.available_size() for s, v in fam.free_lists().items()}
    req = ReqKv(rid=1, seqlen=7)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, 7)
    req.kv_committed_len = 7
    spy = _Spy(alloc, "free_group_begin", "free_segments", "free", "free_group_end")
    fam.protocol.finish(req, fam)
    assert spy.calls[0] == "free_group_begin" and "free_group_end" in spy.calls
    inside = spy.calls[:spy.calls.index("free_group_end")]
    assert inside[1] == "free_segments"  # the row as a segment (page size 1 then piles it with free)
    if getattr(fam, "caches_freed_units", False):  # a prefix tree keeps the finished KV until evicted
        fam.flush_prefix_cache()
    assert {s: v.available_size() for s, v in fam.free_lists().items()} == before


@pytest.mark.parametrize("name", ["swa", "swa-ps4", "swa-ssm-ps4"])
def test_window_eviction_is_one_free_group(api, name):
    """``maybe_evict_swa``'s pass: the SWA slots that slid out come back at the group's end; a row
    ending mid-page at page size 4 keeps its partial page. (The chunk cache's pass: a release whose
    tree serves the config evicts through the tree instead, see test_sglang_trees.)"""
    fam = _family(api, name)
    if hasattr(fam, "tree"):
        pytest.skip(f"sglang {api.version} serves {name} with its prefix tree")
    cfg = fam.config
    swa = fam.free_lists()["swa"]
    req = ReqKv(rid=1, seqlen=cfg.sliding_window + 7)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, cfg.sliding_window + 6)
    req.kv_committed_len = cfg.sliding_window + 6
    free_before = swa.available_size()
    spy = _Spy(fam.sg_allocator, "free_group_begin", "free_group_end")
    fam.protocol.evict_swa(req, fam, cfg.sliding_window + 6)
    assert spy.calls == ["free_group_begin", "free_group_end"]
    ps = cfg.page_size
    assert req.swa_evicted_seqlen == 6 // ps * ps
    assert swa.available_size() == free_before + req.swa_evicted_seqlen
    fam.protocol.finish(req, fam)


def test_each_admission_runs_the_scheduling_passs_mamba_group(api):
    fam = _family(api, "hybrid-linear")
    mamba = getattr(fam.sg_req_pool, "mamba_allocator", None)
    if mamba is None or not hasattr(mamba, "alloc_group_begin"):
        pytest.skip(f"sglang {api.version} has no mamba slot groups")
    first = int(mamba.free_slots[0])
    spy = _Spy(mamba, "alloc_group_begin", "alloc_group_end")
    req = ReqKv(rid=1, seqlen=4)
    fam.protocol.admit(req, fam)
    assert spy.calls == ["alloc_group_begin", "alloc_group_end"]
    # the group took the head slot and gave it back to the tail: the request got the next one
    assert req.mamba_pool_idx != first and int(mamba.free_slots[-1]) == first
    fam.protocol.finish(req, fam)


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "swa-ps4"])
def test_a_speculative_tail_goes_back_as_a_row_segment(api, name):
    """Rejected drafts: positions past the page of the last committed token, as a segment whose end
    may fall mid-page."""
    fam = _family(api, name)
    full = fam.free_lists()["full"]
    req = ReqKv(rid=1, seqlen=4)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, 3)
    req.kv_committed_len = 3
    before = full.available_size()
    fam.protocol.extend(req, fam, 3 + 6)  # the input token and five drafts
    req.kv_committed_len = 5  # one draft accepted
    fam.protocol.free_speculative_tail(req, fam)
    ps = fam.config.page_size
    keep = -(-5 // ps) * ps
    assert req.kv_allocated_len == keep
    assert full.available_size() == before - (-(-keep // ps) - (-(-3 // ps))) * ps
    fam.protocol.finish(req, fam)


def test_the_pools_are_built_with_sglangs_debug_checks(api):
    fam = _family(api, "dense-ps4")
    assert getattr(fam.sg_allocator, "debug_mode", True) is True
