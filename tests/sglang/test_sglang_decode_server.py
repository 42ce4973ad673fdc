"""SGLang's own PD decode server on the CPU (adapters/sglang/decode_server.py, issue 31): pre-allocation, the transfer
queue, decode, retraction with a ``cpu_tensor`` KV backup and its restore all run SGLang's code; the model-runner
stand-in checks before every forward that each request attends to its own K and V, after a transfer and after a
restore alike.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, LostKv

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def decode(scheduling):
    """The decode server's module, where this release's decode queues can be driven (else the test skips)."""
    from poolfuzz.adapters.sglang import decode_server

    reason = decode_server.unsupported_reason(CONFIGS["dense"])
    if reason:
        pytest.skip(reason)
    return decode_server


def _pressure(decode, name="dense"):
    """Six prefilled requests of 6-12 prompt tokens and 20 outputs each on a 48-slot pool: the pre-allocation
    budget admits them on what the running requests could give back, and decode runs out of slots."""
    driver = decode.SglangDecodeDriver(CONFIGS[name])
    rids = [driver.add_request(length=n, share=0, max_tokens=20) for n in (10, 12, 9, 11, 8, 6)]
    reqs = [driver.requests[rid] for rid in rids]
    return driver, rids, reqs


@pytest.mark.parametrize("name", ["dense", "swa", "dense-ps4", "swa-ssm", "hybrid-linear"])
def test_fuzzed_traffic_is_transferred_decoded_retracted_and_restored_on_its_own_kv(decode, expect, name):
    """Before #35957's fix (0.5.18) a retracted swa-ssm request loses its recurrent state: the fuzzer finds it."""
    drivers = []

    def factory(config):
        drivers.append(decode.SglangDecodeDriver(config))
        return drivers[-1]

    machine = scheduled_machine(CONFIGS[name], driver_factory=factory)
    if name == "swa-ssm" and expect == "35957":
        with pytest.raises(StateLost, match=r"mamba\.\w+ layer \d+ position \d+"):
            run_state_machine_as_test(machine, settings=SETTINGS)
        return
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert sum(d.transferred for d in drivers) >= 20  # requests whose prompt KV the prefill stand-in landed
    assert sum(d.retracted for d in drivers) > 0  # retract_decode took running requests back, backed up


def test_decode_memory_pressure_backs_up_and_restores_the_retracted_requests(decode, monkeypatch):
    """retract_decode backs a running request's KV up to CPU tensors (``Req.offload_kv_cache``), the prealloc queue
    takes it back once there is room (``resume_retracted_reqs``: ``Req.load_kv_cache``), and it runs to its length
    on the restored KV, checked at every forward."""
    driver, rids, reqs = _pressure(decode)
    pool_cls = type(driver.family.sg_allocator.get_kvcache())
    calls = {"get_cpu_copy": 0, "load_cpu_copy": 0}
    for name in calls:
        original = getattr(pool_cls, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(pool_cls, name, counted)
    for _ in range(60):
        driver.step()
    assert driver.transferred == 6 and driver.retracted >= 1
    assert calls["get_cpu_copy"] >= 1 and calls["load_cpu_copy"] == calls["get_cpu_copy"], calls
    assert any(req.retraction_count for req in reqs)
    assert not set(rids) & driver.aborted
    for req in reqs:
        assert type(req.finished_reason).__name__ == "FINISH_LENGTH" and len(req.output_ids) == 20, req
    assert driver.drain() is None


def test_a_restore_that_loses_a_layer_is_caught_and_named(decode, monkeypatch):
    """A backup restored without layer 0's K (what #35957's pool did to the mamba state): the resumed request's
    next forward finds zeros where its own K was, and says which request, component, layer and position."""
    driver, _, _ = _pressure(decode)
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
    driver, _, _ = _pressure(decode, "swa-ssm")
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


@pytest.mark.anchored
def test_a_retracted_sliding_window_and_mamba_request_resumes_on_its_own_state(decode, expect):
    """#35957 through SGLang's own decode server (swa-ssm, sliding-window and mamba layers): under decode memory
    pressure ``retract_decode`` backs each retracted request up with the KV pool's ``get_cpu_copy``. Before the fix
    (0.5.18) that pool's copy ignores the mamba indices and nothing else backs the state up, so the resumed request
    continues from a state that is not its own, and the runner names it; from 0.5.19 the pool declares
    ``cpu_copy_carries_mamba`` and the state is backed up and restored."""
    driver, rids, reqs = _pressure(decode, "swa-ssm")
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


def test_an_extra_buffer_model_is_declined_with_the_reason(decode):
    """A decode server keeps no radix cache (the fake backend refuses the decode radix cache), so no track slots."""
    reason = decode.unsupported_reason(CONFIGS["hybrid-extra-buffer"])
    assert reason is not None and "no extra-buffer track slots" in reason
    with pytest.raises(ConfigError, match="no extra-buffer track slots"):
        decode.build_decode_driver(CONFIGS["hybrid-extra-buffer"])
