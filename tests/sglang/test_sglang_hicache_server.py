"""SGLang's own Scheduler with a host tier (adapters/sglang/scheduler/hicache_server.py, issue 31): write-through to
the host,
eviction to the host under pressure, and load-back of a prefix that ends on the host by SGLang's own PrefillAdder;
the model-runner stand-in checks before every forward that each request attends to its own K and V, loaded back or
not.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from packaging.version import Version

from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, LostKv
from tests.sglang.families import release
from tests.sglang.servers import shared_traffic

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


def _counted_load_backs(monkeypatch, tree_cls) -> dict:
    """How many host hits SGLang's prefill adder loaded back (``init_load_back`` answering tokens)."""
    calls = {"loaded": 0}
    original = tree_cls.init_load_back

    def counted(self, *args, **kwargs):  # (params), or before 0.5.10 its fields one by one
        out = original(self, *args, **kwargs)
        if out is not None:  # (tokens loaded, node); 0.5.20 answers the loaded device indices instead of a count
            loaded = out[0]
            calls["loaded"] += (loaded.numel() if torch.is_tensor(loaded) and loaded.dim() else int(loaded)) > 0
        return out

    monkeypatch.setattr(tree_cls, "init_load_back", counted)
    return calls


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "mla", "hybrid-linear", "swa", "swa-ps4", "swa-ssm"])
def test_fuzzed_traffic_is_written_through_evicted_to_the_host_and_loaded_back_on_its_own_kv(hicache_server, api,
                                                                                           monkeypatch, name):
    """Hypothesis's traffic through SGLang's scheduler on a server with ``--enable-hierarchical-cache``: every
    forward attends to its own K and V (and recurrent state), including the prefixes written through to the host and
    those the prefill adder loaded back from it."""
    reason = hicache_server.unsupported_reason(CONFIGS[name])
    if reason:
        pytest.skip(reason)
    from tests.judged import PassOverJudged

    drivers = []

    def factory(config):
        drivers.append(hicache_server.SglangHiCacheDriver(config))
        return drivers[-1]

    # the release's judged defects through this server passed over (0.5.23: a mamba model's stale copy-on-write after
    # an L3 re-query, docs/bugs/sglang-hybrid-l3-stale-mamba-cow.md, anchored below; 0.5.18 to 0.5.22, the list of
    # those releases: the window off the page grid on swa-ps4, the sliding-window load-back shortfall on swa)
    judged = PassOverJudged("sglang", api.version, name, family="sglang:hicache")
    run_state_machine_as_test(scheduled_machine(CONFIGS[name], driver_factory=factory, observer=judged),
                              settings=SETTINGS)
    assert all(d.server.enable_hierarchical_cache and d.tree.cache_controller is not None for d in drivers)
    assert sum(d.hits for d in drivers) > 0 and sum(d.host_tokens for d in drivers) > 0


@pytest.mark.parametrize("name", ["dense", "dense-ps4", "mla", "hybrid-linear", "swa", "swa-ps4"])
def test_prefixes_evicted_to_the_host_are_loaded_back_by_the_prefill_adder(hicache_server, api, monkeypatch, name):
    """Under pressure the tree demotes backed-up prefixes to the host; a later request matching one is loaded back by
    SGLang's PrefillAdder (``init_load_back``), and runs on the loaded K and V, checked at every forward.

    SGLang 0.5.18 to 0.5.22, a window off the page grid (swa-ps4; judged, ci/known/sglang-0.5.18-0.5.22.txt,
    anchored in test_sglang_scheduling_swa_window.py): ``free_swa_out_of_window_slots`` keeps ``max(window, page)``
    tokens floored to a page, the rematch refuses the leaf the insert made, and the next allocation evicts the
    unlocked nodes the request still reads: request 2 reads request 4's KV at step 9. 0.5.23's frontier (rounded up
    to whole pages) patched into 0.5.21 serves this traffic; 0.5.16, 0.5.17 and 0.5.23 serve it."""
    reason = hicache_server.unsupported_reason(CONFIGS[name])
    if reason:
        pytest.skip(reason)
    driver = hicache_server.SglangHiCacheDriver(CONFIGS[name])
    if name == "swa-ps4" and Version("0.5.18") <= release(api) < Version("0.5.23"):
        with pytest.raises(LostKv, match=r"^req 000002 step 9: full\.k layer 0 position 12: block 16 slot 16 holds "
                                         r"req 000004's position 16 \(another prefix\)"):
            shared_traffic(driver)
        return
    loads = _counted_load_backs(monkeypatch, type(driver.tree))
    shared_traffic(driver)
    assert loads["loaded"] > 0, "no prefix was loaded back from the host"
    assert driver.drain() is None


def test_a_load_back_that_loses_a_layer_is_caught_and_named(hicache_server, monkeypatch):
    """A host->device load that lands every layer but layer 0's K: the request that matched the loaded prefix finds
    zeros where its own K was, and the runner says which request, component, layer and position."""
    driver = hicache_server.SglangHiCacheDriver(CONFIGS["dense"])
    tree_cls, kv = type(driver.tree), driver.family.sg_allocator.get_kvcache()
    original = tree_cls.ready_to_load_host_cache

    def loses_layer_0(self):
        queued = [op.device_indices for op in self.cache_controller.load_queue]
        started = original(self)
        for rows in queued:
            kv.k_buffer[0][rows.to(torch.int64)] = 0
        return started

    monkeypatch.setattr(tree_cls, "ready_to_load_host_cache", loses_layer_0)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.k layer 0 position \d+: .*holds zeros"):
        shared_traffic(driver)


def test_the_host_tier_holds_written_through_prefixes_and_drains_clean(hicache_server):
    """Write-through backs every cached prefix up to the host; the idle server's own leak checks pass at the end."""
    driver = hicache_server.SglangHiCacheDriver(CONFIGS["dense"])
    shared_traffic(driver, steps=60)
    assert driver.host_tokens > 0
    assert driver.drain() is None


def test_a_model_whose_tree_has_no_host_tier_is_declined_with_the_reason(hicache_server, api):
    """A model of only sliding-window layers: SGLang's registry builds it a tree without a host tier, whose
    ``check_hicache_events`` (polled by the Scheduler every step) raises; the server is declined saying so (0.5.16 on;
    0.5.15's server crashes at startup instead)."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason as plain_server_reason

    if why := plain_server_reason(CONFIGS["swa-only"]):  # a release that builds no pools for it (before 0.5.15)
        pytest.skip(f"no server of this release runs an all-SWA model: {why}")
    if release(api) < Version("0.5.16"):
        # 0.5.15 (judged; ci/known/sglang-0.5.9-0.5.15.txt): the registry builds the unified tree, whose SWA host stack
        # sizes a 0-byte host pool for the full-attention layers the model lacks: the server cannot start
        assert hicache_server.unsupported_reason(CONFIGS["swa-only"]) is None  # a crash, not a refusal: fuzzed
        with pytest.raises(OSError, match="Invalid argument"):
            hicache_server.build_hicache_driver(CONFIGS["swa-only"])
        return
    reason = hicache_server.unsupported_reason(CONFIGS["swa-only"])
    assert reason is not None and "has no host tier" in reason, reason
    with pytest.raises(ConfigError, match="has no host tier"):
        hicache_server.build_hicache_driver(CONFIGS["swa-only"])


def _counted_storage_loads(monkeypatch, tree_cls) -> dict:
    """Tokens the scheduler's prefetches brought back from L3 storage (``pop_prefetch_loaded_span``)."""
    calls = {"tokens": 0}
    original = tree_cls.pop_prefetch_loaded_span

    def counted(self, handle):
        out = original(self, handle)
        calls["tokens"] += int(out[0] or 0)
        return out

    monkeypatch.setattr(tree_cls, "pop_prefetch_loaded_span", counted)
    return calls


# file backend at page size 1, the zero-copy stand-in paged; MLA's latent pages; a hybrid tree's mamba state beside
@pytest.mark.parametrize("name", ["dense", "dense-ps4", "mla", "hybrid-linear"])
def test_prefixes_that_left_the_host_are_prefetched_from_storage_by_the_scheduler(hicache_server, monkeypatch, name):
    """With an L3 tier below the host, written-through prefixes are backed up into storage; once the host has let
    them go, a request that shares one is prefetched by the Scheduler's own ``_add_request_to_queue`` and admitted by
    ``get_new_batch_prefill`` once the pages are host nodes: it runs on the K and V read back from storage, checked at
    every forward, and the server drains clean."""
    from poolfuzz.adapters.sglang.host_tier import l3

    reason = hicache_server.unsupported_reason(CONFIGS[name])
    if reason:
        pytest.skip(reason)
    if why := hicache_server.storage_problem(CONFIGS[name]):
        pytest.skip(why)
    driver = hicache_server.SglangHiCacheDriver(CONFIGS[name])
    assert l3.enabled(driver.tree) and driver.server.enable_hicache_storage
    loads = _counted_storage_loads(monkeypatch, type(driver.tree))
    shared_traffic(driver)
    assert loads["tokens"] > 0, "nothing was prefetched from storage"
    assert driver.drain() is None
    directory = driver.storage_dir
    driver.close()
    import os

    assert not os.path.exists(directory)
    assert not any(t.is_alive() for t in (getattr(driver.tree.cache_controller, n, None) for n in l3.STORAGE_THREADS)
                   if t is not None)


def test_a_server_with_storage_hashes_a_page_before_its_first_request(hicache_server, monkeypatch):
    """SGLang compiles its page hash (a C++ extension, 0.5.16 on) the first time a process hashes. The server does that
    before any request, so the build never runs on the prefetch thread under the storage deadline (stop 70: a 36 s build
    there was reported as a StorageHang on 0.5.19)."""
    if why := hicache_server.storage_problem(CONFIGS["dense"]):
        pytest.skip(why)
    from sglang.srt.mem_cache import utils

    hashed = []
    original = utils.get_hash_str
    monkeypatch.setattr(utils, "get_hash_str", lambda *a, **k: hashed.append(a) or original(*a, **k))
    driver = hicache_server.SglangHiCacheDriver(CONFIGS["dense"])
    try:
        assert hashed == [([0],)], hashed  # once, before the server took a request
    finally:
        driver.close()


def test_a_page_storage_hands_back_wrong_is_caught_and_named(hicache_server, monkeypatch):
    """Storage that hands back a page of zeros (a backend that lost an object): the request admitted on the prefetched
    prefix finds zeros where its own K was, and the runner says which request, component, layer and position."""
    if why := hicache_server.storage_problem(CONFIGS["dense"]):
        pytest.skip(why)
    driver = hicache_server.SglangHiCacheDriver(CONFIGS["dense"])
    host_cls = type(driver.tree.cache_controller.storage_host_pool)
    original = host_cls.set_from_flat_data_page

    def lost(self, index, data_page):
        return original(self, index, torch.zeros_like(data_page))

    monkeypatch.setattr(host_cls, "set_from_flat_data_page", lost)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.k layer 0 position \d+: .*holds zeros"):
        shared_traffic(driver)
    driver.close()


# The fuzzer's program (sglang:hicache, hybrid-linear, 60 examples, seed 1), reduced step by step while it kept
# failing the same way: nine requests queued, four scheduler steps, then the drain.
STALE_COW_PROGRAM = [(1, 2, 1), (16, 3, 4), (6, 2, 8), (1, 1, 3), "4 steps", (6, 3, 3), (12, 2, 5), (21, 0, 8),
                     (18, 3, 4), (4, 2, 7)]


def _stale_cow_server(hicache_server):
    """The program's server after its program: (driver, the LostKv its drain raised or None)."""
    driver = hicache_server.SglangHiCacheDriver(CONFIGS["hybrid-linear"])
    for step in STALE_COW_PROGRAM:
        if step == "4 steps":
            for _ in range(4):
                driver.step()
        else:
            length, share, max_tokens = step
            driver.add_request(length=length, share=share, max_tokens=max_tokens)
    try:
        driver.drain()
    except LostKv as exc:
        return driver, exc
    return driver, None


@pytest.mark.anchored
def test_a_load_back_after_a_storage_requery_keeps_the_stale_mamba_copy_on_write(hicache_server, api, monkeypatch):
    """SGLang 0.5.23, hybrid model, HiCache with an L3 tier (docs/bugs/sglang-hybrid-l3-stale-mamba-cow.md): a queued
    request whose device prefix shrank before admission is matched with copy-on-write (its mamba slot, the source a
    1-token node), then ``_prefetch_after_device_hit_loss`` re-queries storage and skips it. Next step the storage
    hit comes back through the host and ``init_load_back`` loads the prefetched node's state into that same slot, but
    the stale copy-on-write is still pending and runs at the forward: the request decodes on the state after token 0.
    Without the L3 tier the same traffic passes, and so it does with the report's fix."""
    from poolfuzz.adapters.sglang.host_tier import l3

    if Version(api.version) < Version("0.5.23"):
        pytest.skip("this program loses the state on 0.5.23 only: 0.5.21 and 0.5.22 run it clean (seen at stop 62; the "
                    "defect was met on 0.5.22 through hybrid-extra-buffer-ps4, ci/known/sglang-0.5.23.txt; earlier "
                    "releases not judged)")
    driver, lost = _stale_cow_server(hicache_server)
    driver.close()
    assert lost is not None and re.match(r"req \d+ step \d+: mamba\.conv0 layer 0 position 6: .*holds the state after "
                                         r"req 000001's position 0 \(another prefix\)", str(lost)), lost
    with monkeypatch.context() as without_l3:
        without_l3.setattr(l3, "storage_problem", lambda api, config: "no L3 tier")
        driver, lost = _stale_cow_server(hicache_server)
        driver.close()
        assert driver.storage_dir is None and lost is None
    # the fix the report proposes: a load-back that writes the request's state supersedes its pending copy-on-write
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    prepare, finalize = MambaComponent.prepare_load_back, MambaComponent.finalize_load_back
    loads_state = {}

    def prepared(self, node_id, *, req=None):
        if req is not None:
            loads_state[id(req)] = self.tree_core.component_has_host_value_only(node_id, self.component_type)
        return prepare(self, node_id, req=req)

    def finalized(self, req, prep, success):
        finalize(self, req, prep, success)
        if success and req is not None and loads_state.get(id(req)):
            self._adopt_loaded_state(req)

    monkeypatch.setattr(MambaComponent, "prepare_load_back", prepared)
    monkeypatch.setattr(MambaComponent, "finalize_load_back", finalized)
    driver, lost = _stale_cow_server(hicache_server)
    driver.close()
    assert driver.storage_dir is not None and lost is None


@pytest.mark.anchored
def test_the_host_and_device_pools_are_addressable_by_the_kernel_copies_without_pd_registration(hicache_server):
    """The ``kernel`` copies' stand-in reads only registered buffers. 0.5.18's tree has no ``host_pool_group``: its
    pools were registered only where PD registration happened to list them, and an MXFP8 pool it cannot list
    (``get_contiguous_buf_infos`` raises) made every copy an IllegalAddress of the stand-in's own making. With the
    tree's host pool and the device pool it mirrors registered (``compat.host_tier_pools``), the fuzzer finds what 0.5.18 really does there: a load-back restores the KV
    with stale scales (sglang PR #39089, "Back up MXFP8 KV scales in the host pool", fixed later; 0.5.23 refuses the
    server)."""
    from poolfuzz.adapters.sglang.host_tier import kernel_io

    config = CONFIGS["fp8-scaled"]
    if reason := hicache_server.unsupported_reason(config):
        pytest.skip(reason)
    driver = hicache_server.build_hicache_driver(config)
    try:
        device = driver.family.sg_kv_pool
        for buffer in (device.k_buffer[0], device.v_buffer[-1]):
            assert buffer.untyped_storage().data_ptr() in kernel_io.REGISTRY.spans
    finally:
        driver.close()


# shrunk from poolfuzz run --family sglang --examples 60 --seed 1 (sglang:hicache swa), then by hand: 15 requests
OVER_COMMITTED = [(23, 0, 2), (17, 4, 4), (4, 4, 8), (4, 3, 1), (16, 2, 7), (4, 0, 7), (18, 1, 2), (24, 0, 3),
                  (24, 0, 3), (11, 2, 2), (2, 3, 4), (21, 2, 6), (6, 1, 7), (14, 4, 4), (16, 0, 6)]


def test_a_host_hit_loaded_back_leaves_the_admitted_sliding_window_chunk_short(hicache_server, scheduling, api):
    """SGLang 0.5.21 to 0.5.23, a sliding-window model on a HiCache server (judged an engine defect; ci/known/sglang-0.5.23.txt,
    close to open sglang#31771): PrefillAdder admits a prompt whose prefix is matched on the host tier against SWA
    evictable space that still counts the matched path; ``init_load_back`` then pins that path, and
    ``alloc_for_extend`` finds the SWA side a token short: SGLang's own out-of-memory error kills the scheduler
    (``SWAPrefillBudget`` does not re-price after load-back). The same traffic passes without the host tier."""
    if Version(api.version) < Version("0.5.21"):
        pytest.skip("judged on SGLang 0.5.21 to 0.5.23 (0.5.18 to 0.5.20 schedule this traffic without the shortfall; "
                    "not judged there)")

    def run(driver):
        for length, share, max_tokens in OVER_COMMITTED:
            driver.add_request(length=length, share=share, max_tokens=max_tokens)
        return driver.drain()

    with pytest.raises(RuntimeError, match=r"Out of memory\. Try to lower your batch size\.(.|\n)*Available swa"):
        run(hicache_server.build_hicache_driver(CONFIGS["swa"]))
    assert run(scheduling.SglangSchedulerDriver(CONFIGS["swa"])) is None


@pytest.mark.anchored
@pytest.mark.parametrize("name", ["hybrid-linear", "mla-ssm"])
def test_a_mamba_prefix_loaded_back_from_the_host_is_copied_only_once_its_state_has_landed(hicache_server, api, name):
    """SGLang 0.5.12's ``HiMambaRadixCache`` (a mamba model's HiCache tree before the unified tree served them; 0.5.10
    too): a 12-token prompt is cached and written through to the host, two 40-token prompts evict it from the device,
    and two requests sharing it arrive together. The first one's match ends on the host-backed mamba node: its
    load-back queues the node's state into a fresh device slot and marks the node as on the device at once
    (``mamba_restore_commit``), but the copy runs only when the batch's forward starts the load
    (``ready_to_load_host_cache``). The second request, matched in the same admission round, copies that slot on
    write (``_match_post_processor``'s ``copy_from``) before it is filled, and continues from zeros (on a GPU: from
    whatever the slot held). sglang#24954 moved the copy-on-write into the forward (``mamba_cow_src_index``; 0.5.14
    has it, where the unified tree serves mamba models): both requests run on the prefix's state. Found by the
    fuzzer's traffic (the 35th request of 100), shrunk to this by hand."""
    if reason := hicache_server.unsupported_reason(CONFIGS[name]):
        pytest.skip(reason)
    driver = hicache_server.SglangHiCacheDriver(CONFIGS[name])
    driver.add_request(length=12, share=0, max_tokens=1)
    assert driver.drain() is None
    for _ in range(2):
        driver.add_request(length=40, share=0, max_tokens=1)
        assert driver.drain() is None
    assert driver.host_tokens > 0
    first = driver.add_request(length=2, share=3, max_tokens=2)  # both after the first prompt's 12 tokens
    second = driver.add_request(length=3, share=3, max_tokens=2)
    if release(api) < Version("0.5.13"):
        with pytest.raises(LostKv, match=rf"^req {second} step \d+: mamba\.conv0 layer 0 position 11: .* holds zeros"):
            driver.drain()
        return
    assert driver.drain() is None
    assert driver.first_prefix[first] == driver.first_prefix[second] == 12


def test_a_page_head_host_pool_with_fewer_pages_than_layers_dies_at_startup(hicache_server):
    """A real defect of SGLang (0.5.13 to 0.5.23, docs/bugs/sglang-hicache-page-head-views.md): the MHA host
    pool builds its per-layer transfer views by indexing dimension 0 of its K buffer, which for ``page_head``
    (``[page, head, token, layer, dim]``) counts pages, so a host pool with fewer pages than the model has layers dies
    at the server's startup. Found by a drawn config: three layers on 2-token pages, a device pool of 2 tokens, a host
    pool of 2 pages (2 x --hicache-ratio 1.25, plus one)."""
    from poolfuzz.adapters.sglang import build_hicache_driver
    from poolfuzz.adapters.sglang.host_tier import hicache
    from poolfuzz.pools.config import ModelConfig

    config = ModelConfig(name="cpu-fp8-3l", architecture="llama", page_size=2, full_layers=3, head_num=1, head_dim=12,
                         kv_dtype="fp8_e4m3", kv_quant="cpu_fp8_e4m3", full_tokens=2, request_rows=1, max_context=2)
    if why := build_hicache_driver.unsupported_reason(config):
        pytest.skip(why)
    if hicache.host_layout(config) != "page_head":
        pytest.skip(f"the adapter runs this config's host tier as {hicache.host_layout(config)}, not page_head")
    with pytest.raises(IndexError, match=r"index 2 is out of bounds for dimension 0 with size 2"):
        hicache_server.SglangHiCacheDriver(config)
