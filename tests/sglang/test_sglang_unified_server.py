"""SGLang's own Scheduler on a server with ``--enable-unified-memory`` (adapters/sglang/scheduler/unified_server.py,
issue 31): the prefill adder's joint budget, the unified radix tree and the idle-time compaction are SGLang's; the
model-runner stand-in reads and writes the pool through SGLang's virtual -> physical tables.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, LostKv
from tests.sglang.servers import server_module

SETTINGS = settings(max_examples=10, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


def _fuzzed(api, name: str, driver_cls, *, reason: str | None, family: str) -> list:
    """Hypothesis's traffic through a fresh ``driver_cls`` server an example, the release's judged defects through
    ``family`` passed over (skipped where the server declines ``name``, with ``reason``); the servers built."""
    if reason:
        pytest.skip(reason)
    from tests.judged import PassOverJudged

    drivers = []

    def factory(config):
        drivers.append(driver_cls(config))
        return drivers[-1]

    judged = PassOverJudged("sglang", api.version, name, family=family)
    run_state_machine_as_test(scheduled_machine(CONFIGS[name], driver_factory=factory, observer=judged),
                              settings=SETTINGS)
    return drivers


@pytest.mark.parametrize("name", ["swa", "swa-ps4", "hybrid-linear", "hybrid-extra-buffer"])
def test_fuzzed_traffic_runs_on_its_own_kv_and_state_through_the_unified_pool(unified, api, name):
    """Hypothesis's traffic through SGLang's scheduler on the unified pool: every forward attends to its own K and V
    and continues from its own state, read where SGLang's tables point after every compaction."""
    drivers = _fuzzed(api, name, unified.UnifiedServerDriver, reason=unified.unsupported_reason(CONFIGS[name]),
                      family="sglang:unified-server")
    assert drivers and all(d.server.enable_unified_memory for d in drivers)
    assert all(type(d.tree).__name__ == "UnifiedRadixCache" for d in drivers)
    assert all(c.translate is not None for c, _ in drivers[0].runner.kv)


def test_a_row_lost_at_its_physical_location_is_caught_and_named(unified):
    """The KV of a running request zeroed where SGLang's table puts it (not at its virtual id): the next forward
    finds zeros where the request's own K was, and the runner names the request, component, layer and position."""
    from poolfuzz.adapters.sglang import compat

    driver = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    rid = driver.add_request(length=6, share=0, max_tokens=8)
    driver.step()  # the prefill
    k = next(c for c, _ in driver.runner.kv if c.name == "full.k")
    row = int(compat.request_row(driver.requests[rid]))
    virtual = driver.family.sg_req_pool.req_to_token[row, 2:3].to(torch.int64)
    k.tensor[k.at(virtual)] = 0
    physical = int(k.at(virtual))
    with pytest.raises(LostKv, match=rf"^req {rid} step \d+: full\.k layer {k.layer} position 2: "
                                     rf"block {physical} slot {int(virtual)} holds zeros"):
        for _ in range(4):
            driver.step()


def test_a_model_without_hybrid_layers_is_declined_with_sglangs_reason(unified):
    """SGLang builds the unified pool only for hybrid mamba and sliding-window models: a dense model is declined."""
    reason = unified.unsupported_reason(CONFIGS["dense"])
    assert reason is not None and "only for hybrid Mamba and hybrid SWA models" in reason
    with pytest.raises(ConfigError, match="only for hybrid Mamba and hybrid SWA models"):
        unified.build_unified_driver(CONFIGS["dense"])


# Shrunk by `poolfuzz run --family sglang:unified-server --config mla-ssm --seed 1` on 0.5.23.
# shrunk by poolfuzz run --family sglang:unified-server --config mla-ssm --examples 150 --seed 1 (the conv states in
# SGLang's own bfloat16, as a Kimi-Linear server keeps them)
STALLED = [(19, 0, 8), (20, 4, 5)] + [(1, 0, 1)] * 12


def test_sglangs_unified_admission_stalls_on_mamba_states_its_tree_could_evict(unified, api):
    """SGLang 0.5.23's prefill adder on the unified mamba pool (judged an engine defect,
    docs/bugs/sglang-unified-mamba-admission-stall.md): the full side's budget is its free tokens and the tree's
    full-evictable tokens, but not the shared bytes held by the mamba states the radix tree caches, which evicting
    them would give back. An idle server whose head-of-queue request needs those bytes refuses it every step
    (``NO_TOKEN``), nothing evicts the states, and every request queued behind it waits forever. Evicting the tree's
    mamba states by hand (SGLang's own ``evict``) lets all of them run: room was there."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    driver = unified.build_unified_driver(CONFIGS["mla-ssm"])
    for length, share, max_tokens in STALLED:
        driver.add_request(length=length, share=share, max_tokens=max_tokens)
    for _ in range(60):
        driver.step()
    waiting = [req.rid for req in driver.server.waiting_queue]
    assert waiting and not driver.server.running_batch.reqs, "the server did not stall"
    tree = driver.tree
    assert tree.mamba_evictable_size() > 0
    tree.evict(EvictParams(mamba_num=tree.mamba_evictable_size()))
    for _ in range(60):
        driver.step()
    assert all(driver.outcome.get(rid) == "finished" for rid in waiting), driver.outcome
    assert driver.drain() is None


def test_sglangs_unified_admission_over_commits_the_extra_buffers_track_slots(unified):
    """SGLang 0.5.23's prefill adder on the unified mamba pool reserves the shared bytes of one state slot per new
    request (``_mamba_gap_budget_for_req``: "tracking buffers and radix CoW headroom are not included"); with the
    extra buffer each request's track slots take shared bytes too, so a batch the adder admitted finds the full side
    short at ``alloc_for_extend``, and the scheduler dies with SGLang's own out-of-memory error (judged an engine
    defect, docs/bugs/sglang-unified-mamba-admission-stall.md). The same program on the no-buffer server (hybrid-linear,
    whose pools also differ in size) runs to the end."""
    def shrunk(driver):  # `poolfuzz run --family sglang:unified-server --config hybrid-extra-buffer --seed 3`, shrunk
        driver.add_request(length=20, share=0, max_tokens=5)
        driver.add_request(length=3, share=1, max_tokens=6)
        driver.flush()
        driver.add_request(length=16, share=0, max_tokens=3)
        driver.add_request(length=4, share=4, max_tokens=4)
        for _ in range(3):
            driver.step()
        driver.add_request(length=22, share=1, max_tokens=1)
        for _ in range(3):
            driver.step()

    with pytest.raises(RuntimeError, match=r"Out of memory\. Try to lower your batch size"):
        shrunk(unified.build_unified_driver(CONFIGS["hybrid-extra-buffer"]))
    plain = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    shrunk(plain)
    assert plain.drain() is None


# --- the PD decode server with --enable-unified-memory ------------------------------------------------------------------

@pytest.fixture(scope="module")
def unified_decode(unified):
    """The unified-memory decode server, where this release's decode queues run here (else the test skips)."""
    return server_module("unified_server", "swa", probe="decode_unsupported_reason")


@pytest.mark.parametrize("name", ["swa", "swa-ps4", "hybrid-linear"])
def test_transferred_kv_lands_where_the_decode_side_named_physical_rows(unified_decode, api, name):
    """SGLang's decode side names physical rows for a transfer (``translate_kv_indices_for_transfer``, the window's
    ``translate_swa_indices_for_transfer``, ``translate_mamba_indices``); the prefill stand-in lands the bytes there,
    and every decode step then reads its own K and V (and state) through the tables, compaction included."""
    drivers = _fuzzed(api, name, unified_decode.UnifiedDecodeDriver,
                      reason=unified_decode.decode_unsupported_reason(CONFIGS[name]), family="sglang:unified-decode")
    assert drivers and all(d.runner.lands_physically and d.server.enable_unified_memory for d in drivers)
    assert sum(d.transferred for d in drivers) > 0
    # on the pools SGLang's configurator builds for the Mooncake decode server
    assert {d.pools_origin.built_by for d in drivers} == {"engine"}, drivers[0].pools_origin.detail


def _run(driver, program) -> None:
    for op, *args in program:
        if op == "add":
            driver.add_request(length=args[0], share=args[1], max_tokens=args[2])
        else:
            for _ in range(args[0]):
                driver.step()


# the fuzzer's program on 0.5.23's unified decode server (poolfuzz run --family sglang --examples 60 --seed 1, stop 60)
_ALIASED_BACKUP = [("add", 15, 0, 6), ("add", 13, 0, 3), ("add", 3, 4, 4), ("add", 22, 0, 6), ("add", 12, 0, 5),
                   ("add", 23, 0, 1), ("add", 19, 0, 6), ("add", 3, 0, 4), ("add", 2, 0, 4), ("add", 22, 0, 3),
                   ("add", 20, 2, 8), ("add", 9, 2, 5), ("add", 1, 0, 5), ("add", 1, 1, 1)]


def test_a_retraction_backup_owns_its_memory_as_a_gpus_copy_does(unified_decode, monkeypatch):
    """On a CPU, SGLang's ``MambaPool.get_cpu_copy`` (``temporal[:, idx].to("cpu", non_blocking=True)``, a 0-d slot
    index) returns a view of the live row it backs up, where a GPU copies; the row, freed by ``release_req``, went to
    another request's KV before the retracted request resumed, and the scheduler path reported a loss no GPU server
    has ("req 000013 ...: mamba.temporal layer 0 position 1: block 1 slot 1 holds the state after req 000011's position
    32", an adapter's mistake judged at stop 60). Each offload's aliased tensors are now copied right after it
    (``scheduling.backups_own_memory``) and recorded; without that the same program loses the state."""
    from poolfuzz.adapters.sglang.scheduler import scheduling

    driver = unified_decode.build_unified_decode_driver(CONFIGS["mla-ssm"])
    _run(driver, _ALIASED_BACKUP)
    driver.drain()
    assert driver.family.cpu_aliases, "the program no longer meets an aliased backup: it tests nothing"
    monkeypatch.setattr(scheduling, "backups_own_memory", lambda family: contextlib.nullcontext())
    driver = unified_decode.build_unified_decode_driver(CONFIGS["mla-ssm"])
    with pytest.raises(LostKv, match=r"req 000013 .*mamba\.temporal"):
        _run(driver, _ALIASED_BACKUP)
        driver.drain()


def test_the_tri_pool_loses_a_retracted_requests_state_through_sglangs_own_decode_server(unified_decode, monkeypatch):
    """The tri-pool retraction defect of SGLang 0.5.23 (the since retired pools-path family ``sglang:unified`` found it
    first, docs/bugs/sglang-unified-tri-pool-retraction.md), through SGLang's own decode server: its
    retraction backs the state up with ``UnifiedMambaPool.get_cpu_copy`` and restores it with ``load_cpu_copy``,
    which index physical rows by the request's virtual slot. Two requests suffice: the retracted one resumes on the
    other's final state. With the two methods translating (``host_transfer_translate``), the same program runs."""
    from poolfuzz.pools.errors import LostKv

    # on the pools SGLang's configurator builds for the server (stop 64; on the wiring's, stop 63 shrank another):
    # poolfuzz run --family sglang:unified-decode --config swa-ssm --examples 100 --seed 1 --shrink-seconds 240
    program = [("add", 14, 0, 2), ("step", 1), ("add", 18, 4, 3), ("step", 1), ("add", 7, 4, 2), ("step", 2)]
    driver = unified_decode.build_unified_decode_driver(CONFIGS["swa-ssm"])
    assert driver.pools_origin.built_by == "engine"
    with pytest.raises(LostKv, match=r"^req 000003 step \d+: mamba\.conv0 layer \d+ position 22: .*holds the state "
                                     r"after req 000002's position 35"):
        _run(driver, program)
        driver.drain()
    assert driver.retracted == 1

    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMambaPool

    monkeypatch.setattr(UnifiedMambaPool, "get_cpu_copy",
                        lambda self, idx: MambaPool.get_cpu_copy(self, self.host_transfer_translate(idx)))
    monkeypatch.setattr(UnifiedMambaPool, "load_cpu_copy",
                        lambda self, cpu, idx: MambaPool.load_cpu_copy(self, cpu, self.host_transfer_translate(idx)))
    fixed = unified_decode.build_unified_decode_driver(CONFIGS["swa-ssm"])
    _run(fixed, program)
    assert fixed.drain() is None and fixed.retracted == 1


def test_sglangs_decode_pre_allocation_budget_omits_the_unified_mamba_slots_cost(unified_decode):
    """SGLang 0.5.23's decode pre-allocation on the unified mamba pool admits a transfer its budget says fits, then
    ``alloc`` finds the full side one token short, and the decode server dies of its own assertion ("KV cache is
    full! Bug in memory estimation"): the budget (``_allocatable_token_budgets``) has no term for the shared bytes
    the request's new mamba slot takes, which the prefill adder charges (``mamba_slot_full_token_cost``) and the
    decode side does not (docs/bugs/sglang-unified-mamba-admission-stall.md)."""
    driver = unified_decode.build_unified_decode_driver(CONFIGS["hybrid-linear"])
    # shrunk by poolfuzz run --family sglang:unified-decode --config hybrid-linear --examples 300 --seed 1
    with pytest.raises(AssertionError, match=r"KV cache is full! Bug in memory estimation\. available=22, .*"
                                             r"required_alloc=23"):
        _run(driver, [("add", 14, 0, 4), ("add", 1, 4, 4), ("add", 8, 4, 3), ("step", 3)])


# A drawn Inkling (one full and one window layer, window 1, 12 tokens, one running request) on which an idle decode
# server read "pool memory leak detected! ... [swa] total=12, available=8" (stop 64, left unjudged): its window pool was
# sized by SGLang's configurator in the server's environment (SGLANG_SWA_EVICTION_INTERVAL=1: 8 tokens), the config the
# scheduler was told of without it (SGLang's default interval, 128: 12 tokens). An adapter's mistake, not SGLang's.
_WINDOW_OF_ONE = """
[[config]]
name = "window-of-one"
architecture = "inkling"
page_size = 1
full_layers = 1
swa_layers = 1
mamba_layers = 2
recurrent_layers = "attention"
sliding_window = 1
head_num = 1
head_dim = 16
full_tokens = 12
swa_tokens = 1
request_rows = 1
max_context = 12
mamba_slots = 3
conv_shapes = [[1, 16], [1, 16], [1, 16], [1, 16], [1, 16], [1, 16]]
temporal_shape = [0, 0, 0]
state_dtype = "bfloat16"
chunked_prefill = 16
conservativeness_pct = 10
"""


def test_a_decode_servers_window_pool_is_sized_in_the_environment_it_runs_in(unified_decode, tmp_path):
    """A PD decode server without a radix cache sizes its window pool from its requests' windows and its eviction
    interval (``compute_swa_request_cap``, read from the environment): the config the reference and the scheduler's
    idle check count with is the server's, so an idle server holds every window token it has."""
    from poolfuzz.adapters.sglang.scheduler.model_facts import tokens_per_layer
    from poolfuzz.pools.config_file import load_config_file

    (tmp_path / "c.toml").write_text(_WINDOW_OF_ONE)
    config = load_config_file(str(tmp_path / "c.toml"))[0]
    # never a skip: the decode server starts it (stop 65 skipped it silently for a while, asking the plain server)
    assert unified_decode.decode_unsupported_reason(config) is None, unified_decode.decode_unsupported_reason(config)
    driver = unified_decode.build_unified_decode_driver(config)
    assert driver.pools_origin.built_by == "engine", driver.pools_origin.detail
    sizes = driver.family.served.sizes
    assert tokens_per_layer(driver.family) == (sizes["full_max_total_num_tokens"], sizes["swa_max_total_num_tokens"])
    assert (driver.config.full_tokens, driver.config.swa_tokens) == tokens_per_layer(driver.family)
    assert (driver.server.full_tokens_per_layer, driver.server.swa_tokens_per_layer) == tokens_per_layer(driver.family)
    assert driver.drain() is None
    driver.add_request(length=5, share=0, max_tokens=3)
    assert driver.drain() is None


def _pressing(driver, seed: int, steps: int = 80) -> None:
    """A request every fourth step, some sharing an earlier prefix, more than the pool holds: the tree evicts, the
    allocator leaves holes, and SGLang compacts (urgently, and when the server is idle, ``on_idle``)."""
    import random

    draw = random.Random(seed)
    for i in range(steps):
        if i % 4 == 0:
            driver.add_request(length=draw.randint(2, 14), share=draw.randint(0, 3), max_tokens=draw.randint(1, 4))
        driver.step()


def _counted_moves(monkeypatch, driver, *, copy: bool) -> list[int]:
    """Pages SGLang's compaction moved (``MultiEndedAllocator._move_pages``); with ``copy`` False it rebinds the
    tables but moves no data, a planted defect."""
    cls = type(driver.family.sg_allocator.full_attn_allocator)
    if not hasattr(cls, "_move_pages"):
        pytest.skip(f"{cls.__name__} has no _move_pages (its compaction moves pages another way)")
    moves, real = [], cls._move_pages

    def move(self, src, dst):
        moves.append(src.numel())
        if copy:
            real(self, src, dst)

    monkeypatch.setattr(cls, "_move_pages", move)
    return moves


def test_rows_compaction_moves_are_read_where_the_tables_point(unified, monkeypatch):
    """Under pressure SGLang compacts the unified pool while requests and cached prefixes hold rows; every forward
    still finds its own K, V and state, read through the rebound tables."""
    driver = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    moves = _counted_moves(monkeypatch, driver, copy=True)
    _pressing(driver, seed=2)
    assert sum(moves) > 0 and driver.drain() is None


def test_a_compaction_that_moves_no_data_is_caught_as_another_requests_kv(unified, monkeypatch):
    """The same traffic with a compaction that rebinds the tables but copies nothing: a request reads another
    request's K where its own should have moved, and the runner names both."""
    driver = unified.build_unified_driver(CONFIGS["hybrid-linear"])
    _counted_moves(monkeypatch, driver, copy=False)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: .* holds (req \d+'s position \d+|the state after req \d+'s "
                                     r"position \d+) \(another prefix\)"):
        _pressing(driver, seed=2)
        driver.drain()
