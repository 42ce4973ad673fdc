"""SGLang's own PD decode server on the CPU (adapters/sglang/scheduler/decode_server.py, issue 31):
pre-allocation, the transfer
queue, decode, retraction with the KV backup SGLang resolves for the pools (``host_pool`` into the tree's host tier, or
``cpu_tensor``) and its restore all run SGLang's code; the model-runner stand-in checks before every forward that each
request attends to its own K and V, after a transfer and after a restore alike.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from packaging.version import Version

from poolfuzz.adapters.sglang import compat
from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, LostKv
from tests.sglang.families import release
from tests.sglang.servers import server_module

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def decode(scheduling):
    """The decode server's module, where this release's decode queues can be driven (else the test skips)."""
    return server_module("decode_server", "dense")


def _pressure(decode, name="dense", backup_mode=None):
    """Six prefilled requests of 6-12 prompt tokens and 20 outputs each on a 48-slot pool: the pre-allocation
    budget admits them on what the running requests could give back, and decode runs out of slots."""
    driver = decode.SglangDecodeDriver(CONFIGS[name], backup_mode=backup_mode)
    rids = [driver.add_request(length=n, share=0, max_tokens=20) for n in (10, 12, 9, 11, 8, 6)]
    reqs = [driver.requests[rid] for rid in rids]
    return driver, rids, reqs


@pytest.mark.parametrize("name", ["dense", "swa", "dense-ps4", "swa-ssm", "hybrid-linear"])
def test_fuzzed_traffic_is_transferred_decoded_retracted_and_restored_on_its_own_kv(decode, expect, name):
    """Before #35957's fix (0.5.18) a retracted swa-ssm request loses its recurrent state: the fuzzer finds it."""
    if reason := decode.unsupported_reason(CONFIGS[name]):
        pytest.skip(reason)  # no server of this release (swa-ssm before 0.5.16: no Inkling)
    drivers = []

    def factory(config):  # a model with recurrent state backs up as cpu_tensor, as #35957's reporter ran it
        drivers.append(decode.SglangDecodeDriver(config, backup_mode="cpu_tensor" if config.has_mamba else None))
        return drivers[-1]

    machine = scheduled_machine(CONFIGS[name], driver_factory=factory)
    if name == "swa-ssm" and expect == "35957":
        with pytest.raises(StateLost, match=r"mamba\.\w+ layer \d+ position \d+"):
            run_state_machine_as_test(machine, settings=SETTINGS)
        return
    run_state_machine_as_test(machine, settings=SETTINGS)
    # Whether 25 drawn programs run decode short enough to retract depends on the draws, which move with any edit of
    # the package (Hypothesis draws the literals of its modules): the pressure test below pins retraction down.
    assert sum(d.transferred for d in drivers) >= 20  # requests whose prompt KV the prefill stand-in landed


def _backs_up_a_request(driver) -> bool:
    """Whether the retraction backup holds a request of a few dozen tokens: CPU tensors always; a host pool where it
    has that many slots (0.5.20 sizes a backup-only one at a fifth of the device pool, 0.5.22 on at least a request's
    maximum length)."""
    tokens = driver.host_backup_tokens
    return tokens is None or tokens >= driver.config.max_context // 2


# a full-attention KV; KV beside mamba state (the state backed up and restored too)
@pytest.mark.parametrize("name", ["dense", "hybrid-linear"])
def test_decode_memory_pressure_backs_up_and_restores_the_retracted_requests(decode, monkeypatch, name):
    """With ``--disaggregation-decode-retraction-backup cpu_tensor``, retract_decode backs a running request's KV up
    to CPU tensors (``Req.offload_kv_cache``), the prealloc queue takes it back once there is room
    (``resume_retracted_reqs``: ``Req.load_kv_cache``), and it runs to its length on the restored KV (and recurrent
    state), checked at every forward."""
    driver, rids, reqs = _pressure(decode, name, backup_mode="cpu_tensor")
    assert driver.backup_mode == "cpu_tensor"
    calls = _counted(monkeypatch, type(driver.family.sg_allocator.get_kvcache()), ["get_cpu_copy", "load_cpu_copy"])
    for _ in range(60):
        driver.step()
    assert driver.transferred == 6 and driver.retracted >= 1
    assert calls["get_cpu_copy"] >= 1 and calls["load_cpu_copy"] == calls["get_cpu_copy"], calls
    assert any(req.retraction_count for req in reqs)
    assert not set(rids) & driver.aborted
    for req in reqs:
        assert type(req.finished_reason).__name__ == "FINISH_LENGTH" and len(req.output_ids) == 20, req
    assert driver.drain() is None


def _host_pool_release():
    """Skip where the release's decode server has no host-pool retraction: before 0.5.18 it backs every retracted
    request up as per-request CPU tensors, with no flag to choose another."""
    if not compat.has_retraction_backup_flag():
        pytest.skip(f"SGLang {compat.release()}'s decode server backs retracted requests up as per-request CPU tensors "
                    "only (no --disaggregation-decode-retraction-backup, no host-pool retraction: 0.5.18 on)")


def _host_pool_methods(tree) -> tuple[str, str]:
    """The tree's host-pool backup and restore methods (0.5.18 named them ``retraction_backup`` / ``_restore``)."""
    pairs = [("backup_kv_cache", "restore_kv_cache"), ("retraction_backup", "retraction_restore")]
    return next(pair for pair in pairs if all(hasattr(tree, name) for name in pair))


def _counted(monkeypatch, cls, names) -> dict:
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("name", ["dense", "swa", "dense-ps4"])
def test_sglang_resolves_a_host_pool_backup_and_the_retracted_requests_resume_from_it(decode, monkeypatch, name):
    """Unset, the backup is SGLang's to resolve on the built pools (``resolve_decode_retraction_backup``): a model
    without recurrent state gets ``host_pool``, and the disabled tree a host tier (``init_hicache``). retract_decode
    backs a request up into it (``UnifiedRadixCache.backup_kv_cache``: every layer, and the SWA window), the prealloc
    queue restores it (``restore_kv_cache``), and it continues on its own K and V, checked at every forward. A
    request the host pool cannot hold is answered with an abort (0.5.20's backup-only pool is a fifth of the device
    pool; 0.5.22 on give it room for one request): never resumed on another's KV."""
    _host_pool_release()
    driver, rids, reqs = _pressure(decode, name)
    assert driver.backup_mode == "host_pool" and driver.tree.cache_controller is not None
    backup, restore = _host_pool_methods(driver.tree)
    calls = _counted(monkeypatch, type(driver.tree), [backup, restore])
    for _ in range(60):
        driver.step()
    assert driver.transferred == 6 and calls[backup] >= 1, calls
    if _backs_up_a_request(driver):
        assert driver.retracted >= 1 and calls[restore] >= 1, calls
    assert driver.drain() is None
    for rid, req in zip(rids, reqs):
        if rid in driver.aborted:  # the host pool could not hold it (0.5.20's fifth of the device pool)
            assert not _backs_up_a_request(driver)
            assert "host KV pool exhausted" in (req.to_finish or req.finished_reason).message, req
        else:  # it ran to its length (20, or what init_req_max_new_tokens clipped it to at admission)
            assert type(req.finished_reason).__name__ == "FINISH_LENGTH", req
            assert len(req.output_ids) == req.sampling_params.max_new_tokens, req


def test_a_host_pool_restore_that_loses_a_layer_is_caught_and_named(decode, monkeypatch):
    """A host-pool restore that lands every layer but layer 0's V: the resumed request's next forward finds zeros
    where its own V was, and says which request, component, layer and position."""
    _host_pool_release()
    driver, _, _ = _pressure(decode)
    assert driver.backup_mode == "host_pool"
    tree_cls, kv = type(driver.tree), driver.family.sg_allocator.get_kvcache()
    restore = _host_pool_methods(driver.tree)[1]
    original = getattr(tree_cls, restore)

    def loses_layer_0(self, req, backup):
        original(self, req, backup)
        row = compat.request_row(req)
        kv.v_buffer[0][driver.family.sg_req_pool.req_to_token[row, :req.seqlen - 1].to(torch.int64)] = 0

    monkeypatch.setattr(tree_cls, restore, loses_layer_0)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.v layer 0 position \d+: .*holds zeros"):
        for _ in range(60):
            driver.step()


def test_a_model_with_recurrent_state_resolves_to_cpu_tensor_and_refuses_a_named_host_pool(decode):
    """SGLang's resolution keeps a model with mamba layers on ``cpu_tensor`` (a host pool has no recurrent-state
    sidecar); naming ``host_pool`` for one is refused with SGLang's own message, not fuzzed. Before 0.5.18 there is
    nothing to resolve or name: the refusal names the missing flag."""
    assert decode.SglangDecodeDriver(CONFIGS["hybrid-linear"]).backup_mode == "cpu_tensor"
    if not compat.has_retraction_backup_flag():
        with pytest.raises(ConfigError, match="has no --disaggregation-decode-retraction-backup"):
            decode.build_decode_driver(CONFIGS["hybrid-linear"], backup_mode="host_pool")
        return
    with pytest.raises(ConfigError, match="(?i)host-pool retraction does not support mamba|host_pool"):
        decode.build_decode_driver(CONFIGS["hybrid-linear"], backup_mode="host_pool")


def test_a_restore_that_loses_a_layer_is_caught_and_named(decode, monkeypatch):
    """A backup restored without layer 0's K (what #35957's pool did to the mamba state): the resumed request's
    next forward finds zeros where its own K was, and says which request, component, layer and position."""
    driver, _, _ = _pressure(decode, backup_mode="cpu_tensor")
    pool_cls = type(driver.family.sg_allocator.get_kvcache())
    original = pool_cls.load_cpu_copy

    def loses_layer_0(self, kv_cache_cpu, indices, *args, **kwargs):
        original(self, kv_cache_cpu, indices, *args, **kwargs)
        self.k_buffer[0][indices] = 0

    monkeypatch.setattr(pool_cls, "load_cpu_copy", loses_layer_0)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.k layer 0 position \d+: .*holds zeros"):
        for _ in range(60):
            driver.step()


def test_a_restore_that_loses_the_recurrent_state_is_caught_and_named(decode, monkeypatch):
    """#35957's loss through SGLang's own decode server (swa-ssm: sliding-window and mamba layers): a retracted
    request's mamba state restored as zeros. Its next forward finds the state it continues from is not the state of
    its own tokens, and says which request, which layer and which slot."""
    driver, _, _ = _pressure(decode, "swa-ssm", backup_mode="cpu_tensor")
    pool_cls = type(driver.family.sg_req_pool.mamba_pool)
    original = pool_cls.load_cpu_copy

    def restores_zeros(self, mamba_cache_cpu, indices, *args, **kwargs):
        original(self, mamba_cache_cpu, indices, *args, **kwargs)
        self.mamba_cache.temporal[:, indices] = 0
        for conv in self.mamba_cache.conv:
            conv[:, indices] = 0

    monkeypatch.setattr(pool_cls, "load_cpu_copy", restores_zeros)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: mamba\.\w+ layer \d+ .*slot \d+"):
        for _ in range(60):
            driver.step()


def test_a_dsa_backup_without_its_index_cache_is_caught_and_named(decode, api, monkeypatch):
    """DSA's CPU copy left without its indexer keys (the MLA copy alone, as 0.5.9 and 0.5.10's pool inherited it): a
    retracted request resumes on other requests' index keys, and the runner names the ``dsa.index_k`` component."""
    if api.DSATokenToKVPool is None or api.MLATokenToKVPool is None:
        pytest.skip("no DSA pool in this release")
    if reason := decode.unsupported_reason(CONFIGS["dsa-ps64"], backup_mode="cpu_tensor"):
        pytest.skip(reason)
    mla = api.MLATokenToKVPool
    monkeypatch.setattr(api.DSATokenToKVPool, "get_cpu_copy",
                        lambda self, indices, *args, **kwargs: {"kv": mla.get_cpu_copy(self, indices), "index_k": None})
    monkeypatch.setattr(api.DSATokenToKVPool, "load_cpu_copy",
                        lambda self, cpu, indices, *args, **kwargs: mla.load_cpu_copy(self, cpu["kv"], indices))
    driver = decode.SglangDecodeDriver(CONFIGS["dsa-ps64"], backup_mode="cpu_tensor")
    for n in (40, 44, 42, 38, 41, 43):  # six requests of a page and more on a pool of four 64-token pages
        driver.add_request(length=n, share=0, max_tokens=40)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: dsa\.index_k layer \d+ position \d+: "):
        for _ in range(120):
            driver.step()
    assert driver.retracted >= 1


def test_an_mxfp8_restore_that_drops_the_scales_is_caught_and_named(decode, api, monkeypatch):
    """The MXFP8 pool's restore writes the fp8 payload and not its scales (``_write_scales`` skipped in
    ``load_cpu_copy``): a resumed request would dequantise against the exponents of whoever held its slots before,
    and the runner names the scale component."""
    config = CONFIGS["fp8-scaled"]
    if api.MHATokenToKVPoolMXFP8 is None:
        pytest.skip("no MXFP8 pool in this release")
    if reason := decode.unsupported_reason(config, backup_mode="cpu_tensor"):
        pytest.skip(reason)
    pool_cls = api.MHATokenToKVPoolMXFP8
    original = pool_cls.load_cpu_copy

    def drops_scales(self, *args, **kwargs):
        with monkeypatch.context() as inside:
            inside.setattr(self, "_write_scales", lambda *a, **k: None)
            return original(self, *args, **kwargs)

    monkeypatch.setattr(pool_cls, "load_cpu_copy", drops_scales)
    driver = decode.SglangDecodeDriver(config, backup_mode="cpu_tensor")
    for n in (10, 12, 9, 11, 8, 6):
        driver.add_request(length=n, share=0, max_tokens=20)
    with pytest.raises(LostKv, match=r"^req \d+ step \d+: full\.[kv]_scale layer \d+ position \d+: "):
        for _ in range(60):
            driver.step()


@pytest.mark.anchored
def test_a_retracted_sliding_window_and_mamba_request_resumes_on_its_own_state(decode, expect):
    """#35957 through SGLang's own decode server (swa-ssm, sliding-window and mamba layers): under decode memory
    pressure ``retract_decode`` backs each retracted request up with the KV pool's ``get_cpu_copy``. Before the fix
    (0.5.18) that pool's copy ignores the mamba indices and nothing else backs the state up, so the resumed request
    continues from a state that is not its own, and the runner names it; from 0.5.19 the pool declares
    ``cpu_copy_carries_mamba`` and the state is backed up and restored. The server is started with
    ``--disaggregation-decode-retraction-backup cpu_tensor``: on 0.5.18 one without it does not start (the next test)."""
    if reason := decode.unsupported_reason(CONFIGS["swa-ssm"]):  # 0.5.9, 0.5.10: no such decode server
        pytest.skip(reason)
    driver, rids, reqs = _pressure(decode, "swa-ssm", backup_mode="cpu_tensor")
    if expect == "35957":
        with pytest.raises(LostKv, match=r"^req \d+ step \d+: mamba\.\w+ layer \d+ position \d+: block \d+ slot \d+ "
                                         r"holds .*\(expected the recurrent state of its own tokens"):
            for _ in range(60):
                driver.step()
        assert driver.retracted >= 1
    else:
        for _ in range(60):
            driver.step()
        assert driver.retracted >= 1
        assert driver.drain() is None
        for req in reqs:  # each ran to its length (20, or what init_req_max_new_tokens clipped it to at admission)
            assert type(req.finished_reason).__name__ == "FINISH_LENGTH", req
            assert len(req.output_ids) == req.sampling_params.max_new_tokens, req


@pytest.mark.anchored
def test_a_run_on_the_decode_server_finds_35957_and_its_artifact_replays(decode, expect, tmp_path, capsys):
    """What a user runs, ``poolfuzz run --family sglang:decode --config swa-ssm --backup-mode cpu_tensor``: on 0.5.18
    the fuzzer finds a resumed request decoding on a recurrent state that is not its own, on SGLang's own pools, and
    the artifact it writes replays to the same failure; a fixed release passes. (How short the shrink gets within
    ``--shrink-seconds`` depends on the machine's speed, so it is not asserted: 5 steps on an idle 2-core machine.)"""
    from poolfuzz.cli import run_cli
    from poolfuzz.orchestration.artifacts import load

    if reason := decode.unsupported_reason(CONFIGS["swa-ssm"], backup_mode="cpu_tensor"):
        pytest.skip(reason)
    out = tmp_path / "out"
    code = run_cli(["run", "--family", "sglang:decode", "--config", "swa-ssm", "--backup-mode", "cpu_tensor",
                    "--examples", "40", "--seed", "1", "--db", "none", "--out", str(out), "--shrink-seconds", "10"])
    printed = capsys.readouterr().out
    if expect == "pass":
        assert code == 0, printed
        return
    assert code == 1, printed
    arts = {path: load(path) for path in out.glob("*.json")}
    assert arts and all(a.signature.startswith("StateLost:contents:mamba@") for a in arts.values()), printed
    assert "who built the pools the examples ran on: the engine's own code" in printed, printed
    assert re.search(r"StateLost: req \d+ step \d+: mamba\.\w+ layer \d+ position \d+: block \d+ slot \d+ holds",
                     printed), printed
    shortest = min(arts, key=lambda path: len(arts[path].program))
    assert run_cli(["replay", str(shortest)]) == 1  # the recorded program fails again, the same way
    replayed = capsys.readouterr().out
    assert "the same failure as recorded" in replayed, replayed


@pytest.mark.anchored
def test_a_sliding_window_and_mamba_decode_server_with_default_flags_starts_on_cpu_tensor(decode, expect):
    """The other half of #35957: with the backup unset, 0.5.18's resolution picks ``host_pool`` for a model with
    sliding-window and mamba layers (it asks only whether the KV pool is an SWA pool with full tokens), and the tree's
    build refuses it ("Host-pool retraction does not support Mamba models"), so the decode server does not start.
    #35957 made the resolution ask whether the model keeps recurrent state: from 0.5.20 it resolves ``cpu_tensor``.
    On 0.5.18 the decode family then starts the server an operator starts next, with
    ``--disaggregation-decode-retraction-backup cpu_tensor`` (``operator_backup``), on which #35957's state loss shows."""
    from poolfuzz.adapters.sglang.scheduler.servers import server_refusal

    if not compat.has_retraction_backup_flag():  # before 0.5.18: per-request CPU tensors, the only backup there is
        if reason := decode.unsupported_reason(CONFIGS["swa-ssm"]):  # 0.5.9, 0.5.10: no such decode server
            pytest.skip(reason)
        assert server_refusal(CONFIGS["swa-ssm"], decode.SglangDecodeDriver, None) is None
        assert decode.build_decode_driver(CONFIGS["swa-ssm"]).backup_mode == "cpu_tensor"
        return
    if expect == "35957":
        refusal = server_refusal(CONFIGS["swa-ssm"], decode.SglangDecodeDriver, None)
        assert refusal is not None and "Host-pool retraction does not support Mamba models" in refusal, refusal
        assert decode.operator_backup(CONFIGS["swa-ssm"]) == "cpu_tensor"
        assert decode.build_decode_driver(CONFIGS["swa-ssm"]).backup_mode == "cpu_tensor"
    else:
        assert server_refusal(CONFIGS["swa-ssm"], decode.SglangDecodeDriver, None) is None
        assert decode.SglangDecodeDriver(CONFIGS["swa-ssm"]).backup_mode == "cpu_tensor"


def test_an_extra_buffer_model_is_declined_with_the_reason(decode):
    """A decode server keeps no radix cache (the fake backend refuses the decode radix cache), so no track slots."""
    reason = decode.unsupported_reason(CONFIGS["hybrid-extra-buffer"])
    assert reason is not None and "no extra-buffer track slots" in reason
    with pytest.raises(ConfigError, match="no extra-buffer track slots"):
        decode.build_decode_driver(CONFIGS["hybrid-extra-buffer"])


def test_a_prompt_whose_pages_fill_the_pool_is_accepted_but_never_pre_allocated(decode, api):
    """sglang#39271 seen through the decode server's queues, as the fuzzer found it on dsa-ssm-ps64 (64-token pages,
    a 192-token pool and context; that config's pools are no server's, and a DeepSeek DSA server's of that size stands
    in here): a 129-token prompt is accepted with max_new_tokens clipped to 0 (the base
    allocator's max_new_tokens_for_memory floors 192 - 192 - 64 - 1 at 0 instead of answering None, which the
    Scheduler would abort), ``_check_if_req_exceed_kv_capacity`` lets it in (the raw prompt fits the pool), and
    ``pop_preallocated`` wants its three pages plus ``num_reserved_decode_tokens`` within the pool: it waits forever,
    and so would every request behind it. One token shorter (two pages), it is pre-allocated and finishes. Before
    0.5.22 the decode server pre-allocates and finishes the long one too."""
    from poolfuzz.pools.errors import ServerStuck

    from packaging.version import Version

    config = CONFIGS["dsa-ps64"].replace(full_tokens=192, max_context=192)
    if reason := decode.unsupported_reason(config):
        pytest.skip(reason)
    fits = decode.SglangDecodeDriver(config)
    rid = fits.add_request(length=128, share=0, max_tokens=1)
    assert fits.drain() is None and fits.outcome[rid] == "finished"

    driver = decode.SglangDecodeDriver(config)
    rid = driver.add_request(length=129, share=0, max_tokens=1)
    if Version(api.version) < Version("0.5.22"):  # measured at stop 67 on 0.5.12, 0.5.16, 0.5.18, 0.5.20, 0.5.21
        assert driver.drain() is None and driver.outcome[rid] == "finished"  # pre-allocated, as it should be
        return
    with pytest.raises(ServerStuck) as stuck:
        driver.drain()
    assert str(stuck.value) == (f"1 request(s) still unfinished after 400 idle steps (req {rid} waiting for "
                                "pre-allocation with 0 of 0 tokens out)"), stuck.value


@pytest.mark.anchored
def test_a_prompt_that_fits_the_window_pool_but_not_with_its_outputs_is_never_pre_allocated(decode):
    """docs/bugs/sglang-decode-swa-prealloc-stall.md (stop 69; unfixed through 0.5.23): on a decode server of a model
    with sliding-window layers on one-token pages, whose window pool SGLang sizes below its full pool, a prompt that
    fits the window pool is accepted (``_check_if_req_exceed_kv_capacity`` tests the prompt alone), but
    ``pop_preallocated`` budgets its prompt and outputs against the allocator's ``available_size()``, the smaller pool:
    an idle server never admits it, and every request behind it waits too. Six tokens shorter, it fits and finishes.
    Found by the compat table on 0.5.12 (``swa``: full 64, window 32, a 31-token prompt asking for 3 tokens)."""
    from poolfuzz.pools.errors import ServerStuck

    config = CONFIGS["swa"].replace(full_tokens=256, swa_tokens=128, max_context=256)
    if reason := decode.unsupported_reason(config):
        pytest.skip(reason)
    driver = decode.SglangDecodeDriver(config)
    allocator = driver.family.sg_allocator
    window, full = allocator.size_swa, allocator.size_full
    if window >= full:
        pytest.skip(f"this release builds the window pool as large as the full one ({window} of {full} tokens)")
    first = driver.add_request(length=window - 1, share=0, max_tokens=5)
    behind = driver.add_request(length=4, share=0, max_tokens=1)
    with pytest.raises(ServerStuck) as stuck:
        driver.drain()
    assert str(stuck.value) == (f"2 request(s) still unfinished after 400 idle steps (req {first} waiting for "
                                f"pre-allocation with 0 of 5 tokens out, req {behind} waiting for pre-allocation "
                                "with 0 of 1 tokens out)"), stuck.value

    fits = decode.SglangDecodeDriver(config)
    rid = fits.add_request(length=window - 6, share=0, max_tokens=5)  # prompt, outputs and one reserved token fit
    assert fits.drain() is None and fits.outcome[rid] == "finished"


def test_a_dsa_request_retracted_on_a_decode_server_is_backed_up_and_resumes(decode):
    """The decode server's retraction backs a DSA request's KV up through SGLang's ``get_cpu_copy``, whose index cache
    synchronises the device first (``torch.cuda.synchronize``, a no-op stand-in on a machine without a GPU:
    ``shims.cpu_server``). The fuzzer's shrunk program on dsa-ssm-ps64, which crashed with "Torch not compiled with
    CUDA enabled" before the stand-in covered the scheduler path's steps (an adapter gap, not the engine's); run on a
    DeepSeek DSA server of its sizes (``dsa-ssm-ps64``'s pools are no server's)."""
    config = CONFIGS["dsa-ps64"].replace(full_tokens=192, max_context=192)
    if reason := decode.unsupported_reason(config):
        pytest.skip(reason)
    machine = scheduled_machine(config, driver_factory=decode.SglangDecodeDriver)()
    machine.add_request(length=20, share=0, max_tokens=1, priority=0)
    machine.add_request(length=1, share=1, max_tokens=4, priority=0)
    machine.add_request(length=1, share=2, max_tokens=3, priority=0)
    machine.schedule(steps=3, drafts=0)
    assert machine.driver.retracted == 1
    assert machine.driver.drain() is None
    assert set(machine.driver.outcome.values()) == {"finished"}


def test_a_server_that_refuses_its_resolved_backup_starts_with_the_flag_an_operator_adds(decode, api):
    """An MXFP8 MHA model: SGLang resolves ``host_pool`` for its ``MHATokenToKVPool``, and its host tier refuses the
    CPU pool's token-layout scales at startup. Unnamed, the decode family starts the server an operator would start
    next, with ``--disaggregation-decode-retraction-backup cpu_tensor``; its retractions carry the MXFP8 scales
    (sglang#35888), so the requests resume on their own K, V and scales. Naming ``host_pool`` is still refused with
    SGLang's message."""
    from poolfuzz.adapters.sglang.scheduler.servers import server_refusal

    config = CONFIGS["fp8-scaled"]
    if api.MHATokenToKVPoolMXFP8 is None:  # 0.5.12: no such pool, declined before any server is asked
        pytest.skip(f"sglang {api.version} has no MHATokenToKVPoolMXFP8")
    if server_refusal(config, decode.SglangDecodeDriver, None) is None:
        pytest.skip("this release starts the decode server with the backup it resolves")
    if refused := server_refusal(config, decode.SglangDecodeDriver, "cpu_tensor"):  # 0.5.18: no MXFP8 PD at all
        assert decode.operator_backup(config) is None and decode.unsupported_reason(config) == refused
        return
    assert decode.operator_backup(config) == "cpu_tensor" and decode.unsupported_reason(config) is None
    assert "scale layout" in decode.unsupported_reason(config, backup_mode="host_pool")
    driver = decode.build_decode_driver(config)
    assert driver.backup_mode == "cpu_tensor"
    for n in (10, 12, 9, 11, 8, 6):
        driver.add_request(length=n, share=0, max_tokens=20)
    for _ in range(40):
        driver.step()
    assert driver.retracted > 0, "decode never ran short: nothing was backed up"
    assert driver.drain() is None
    assert decode.operator_backup(CONFIGS["dense"]) is None  # a server that starts as resolved keeps SGLang's choice
    from poolfuzz.adapters.sglang import describe_decode_server

    (note,) = describe_decode_server(config).notes  # the listing says the flag was added, and why
    assert note.startswith("started with --disaggregation-decode-retraction-backup cpu_tensor") and "scale layout" in note
    assert describe_decode_server(CONFIGS["dense"]).notes == ()


def test_sglangs_page_check_calls_a_pure_swa_requests_evicted_window_a_use_after_free(decode):
    """SGLang 0.5.23's KV page check (``InvariantChecker._check_kv_page_invariants``, check A, behind
    ``SGLANG_CHECK_KV_PAGE_INVARIANTS``) takes the allocator's first sub-allocator for the full pool; a pure-SWA
    model's allocator has no full pool (``full_attn_allocator is swa_attn_allocator``). A decode that slides the window
    frees the request's out-of-window slots, by design (``free_swa_out_of_window_slots``), and the check then finds the
    request's row still naming them: a false alarm, not a lost page. The fuzzer's shrunk program on ``swa-only``
    (window 6, eviction interval 6: ``environment.server_environment``); known, and written up in
    docs/bugs/sglang-pure-swa-page-check.md."""
    if reason := decode.unsupported_reason(CONFIGS["swa-only"]):
        pytest.skip(reason)
    driver = decode.SglangDecodeDriver(CONFIGS["swa-only"])
    if not hasattr(compat.invariant_checker(driver.server), "_check_kv_page_invariants"):
        pytest.skip("this release's invariant checker has no KV page check")
    assert driver.environment["SGLANG_SWA_EVICTION_INTERVAL"] == "6"  # beside what its argument hooks set
    rid = driver.add_request(length=11, share=0, max_tokens=16)
    req = driver.requests[rid]
    # the window slides at a decode whose forward count is a multiple of the interval: 0.5.23 at the first decode,
    # 0.5.15 (which counts before the step's forward) after six forwards
    for _ in range(7):
        driver.step()
        if _swa_frontier(req):
            break
    evicted = _swa_frontier(req)
    row = driver.family.sg_req_pool.req_to_token[int(compat.request_row(req))]
    freed = row[:evicted].tolist()
    assert evicted > 0 and all(driver.family.free_lists()["swa"].is_free_page(slot) for slot in freed)
    problem = driver.state_problem()
    assert problem is not None and f"KV page use-after-free: {evicted} owner page refs are in the free pool" in problem
    assert driver.drain() is None and driver.outcome[rid] == "finished"  # its window's K and V were its own throughout



@pytest.mark.anchored
def test_a_dsa_request_retracted_on_a_decode_server_is_offloaded_by_the_pools_own_copy(decode, api):
    """sgl-project/sglang#25828 (0.5.12 and 0.5.13; fixed in 0.5.14 by #27645): ``Req.offload_kv_cache`` hands every
    KV pool ``get_cpu_copy(indices, mamba_indices=...)`` (#22493), and the DSA pool's own override (#23346) takes no
    ``mamba_indices``, so a PD decode server of a DeepSeek-V3.2-style model crashes at its first retraction. The
    fuzzer's shrunk program on 0.5.12's decode server (dsa-ps64: 64-token pages): one request, then two that run decode
    short."""
    if reason := decode.unsupported_reason(CONFIGS["dsa-ps64"]):
        pytest.skip(reason)
    if release(api) < Version("0.5.12"):  # 0.5.11 too: it loses dsa.index_k at the resume (judged at stop 62)
        pytest.skip("before 0.5.12 the DSA pool inherits MLA's CPU copy, which leaves the indexer keys behind, and the "
                    "pre-allocation budget overruns paged pools: other judged defects (ci/known/sglang-0.5.9-0.5.15.txt)")
    machine = scheduled_machine(CONFIGS["dsa-ps64"], driver_factory=decode.SglangDecodeDriver)()
    machine.schedule(steps=1, drafts=0)
    machine.add_request(length=1, share=0, max_tokens=1, priority=0)
    machine.schedule(steps=1, drafts=0)
    machine.add_request(length=14, share=1, max_tokens=5, priority=0)
    machine.add_request(length=16, share=1, max_tokens=5, priority=0)
    machine.schedule(steps=1, drafts=0)
    if Version("0.5.12") <= release(api) < Version("0.5.14"):
        with pytest.raises(TypeError, match=r"get_cpu_copy\(\) got an unexpected keyword argument 'mamba_indices'"):
            machine.schedule(steps=3, drafts=0)
        return
    machine.schedule(steps=3, drafts=0)
    assert machine.driver.retracted >= 1
    assert machine.driver.drain() is None
    assert set(machine.driver.outcome.values()) == {"finished"}


@pytest.mark.anchored
def test_an_fp4_decode_server_starts_and_registers_its_kv_buffers(decode, api):
    """sglang#21954 renamed ``KVFP4QuantizeUtil`` (0.5.11) and left ``MHATokenToKVPoolFP4``'s buffer getters importing
    the old name until #28013 (0.5.14): on 0.5.11 to 0.5.13 a PD decode server with FP4 KV raises ImportError at
    startup, when its KV manager asks the pool for its buffers (``get_contiguous_buf_infos``). On the releases before
    and after, the server starts and its requests are transferred and decoded on their own K, V and scales."""
    if reason := decode.unsupported_reason(CONFIGS["dense-fp4"]):
        pytest.skip(reason)
    if Version("0.5.11") <= release(api) < Version("0.5.14"):
        with pytest.raises(ImportError, match="KVFP4QuantizeUtil"):
            decode.build_decode_driver(CONFIGS["dense-fp4"])
        return
    driver = decode.build_decode_driver(CONFIGS["dense-fp4"])  # started as an operator would (0.5.23: cpu_tensor)
    rid = driver.add_request(length=6, share=0, max_tokens=3)
    assert driver.drain() is None and driver.outcome[rid] == "finished" and driver.transferred == 1

def _swa_frontier(req) -> int:
    """How far the request's window has slid: per component on ``req.kv`` (0.5.20 on), a field of ``req.kv`` (0.5.18)
    or of the request (before)."""
    kv = vars(req).get("kv")
    if hasattr(kv, "get_evicted_seqlen"):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        return int(kv.get_evicted_seqlen(ComponentType.SWA))
    return int((kv if hasattr(kv, "swa_evicted_seqlen") else req).swa_evicted_seqlen)


def test_a_recurrent_decode_server_runs_the_requests_and_states_sglang_settles(decode):
    """A decode server leaves its state cache to SGLang (a slot a running request) and caps its running requests at
    what its token slots settle: a recurrent config with more rows than that runs the server SGLang builds for the
    rows read back, state slots and all (stop 65: 2 of 32 drawn examples ran on the adapter's wiring, deleted since).
    Before 0.5.16 the model runner caps them at the flag and the request pool only (0.5.9's ``initialize``, 0.5.10 to
    0.5.15's ``init_memory_pool``): every row is settled, and the server runs on them."""
    from poolfuzz.adapters.sglang.pools import configurator

    config = CONFIGS["hybrid-linear"].replace(name="random", full_tokens=6, request_rows=5, mamba_slots=7)
    if reason := decode.unsupported_reason(config):
        pytest.skip(reason)
    driver = decode.build_decode_driver(config)
    try:
        assert driver.pools_origin.built_by == "engine", driver.pools_origin.detail
        settled = driver.family.served.sizes["max_running_requests"]
        if configurator.builder() == configurator.CONFIGURATOR:
            assert settled < config.request_rows, "SGLang settles every row: the test no longer caps them"
        else:
            assert settled == config.request_rows, "a runner before 0.5.16 capped the rows by their token slots"
        assert (driver.config.request_rows, driver.config.mamba_slots) == (settled, settled)
        assert driver.server_args["max_running_requests"] == settled
    finally:
        driver.close()
