"""SGLang's host_pool retraction backup (HiCache host pools, pool group, controller, tree calls) on the CPU."""

from __future__ import annotations

import pytest
import torch

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError, PoolExhausted
from poolfuzz.pools.request import ReqKv

HOST = ["dense", "swa", "dense-ps4", "swa-ps4"]


def _family(api, config, **kwargs):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason
    from poolfuzz.adapters.sglang.host_tier.host import host_pool_problem

    why = unsupported_reason(config) or host_pool_problem(api, config)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_family(config, **kwargs)


def _served(fam, rid: int, tokens: int) -> ReqKv:
    req = ReqKv(rid=rid, seqlen=tokens + 1)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, tokens)
    req.kv_committed_len = tokens
    return req


def _device_rows(fam, req: ReqKv, tokens: int) -> torch.Tensor:
    slots = fam.sg_req_pool.req_to_token[req.req_pool_idx, :tokens].to(torch.int64)
    pool = getattr(fam.sg_kv_pool, "full_kv_pool", fam.sg_kv_pool)
    return torch.stack([pool.k_buffer[0][slots], pool.v_buffer[0][slots]])


class TestResolution:
    @pytest.mark.parametrize("name", HOST)
    def test_a_decode_server_infers_host_pool_where_sglang_does(self, api, name):
        fam = _family(api, CONFIGS[name])
        assert fam.backup_mode == "host_pool"
        spaces = {"host.full", "host.swa"} if CONFIGS[name].has_swa else {"host.full"}
        assert set(fam.host_pools) == spaces
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        for view in fam.host_pools.values():
            assert isinstance(view.owner, MHATokenToKVPoolHost)
            assert view.available_size() == CONFIGS[name].host_size  # sized by the config, no padding page
            assert 0 in view.free_pages()  # host slot 0 is an ordinary slot

    @pytest.mark.parametrize("name", ["hybrid-linear", "swa-ssm"])
    def test_recurrent_state_stays_on_cpu_tensor(self, api, name):
        """SGLang: "Host-pool retraction does not support Mamba models"."""
        from poolfuzz.adapters.sglang import build_family, unsupported_reason

        if unsupported_reason(CONFIGS[name]):
            pytest.skip(unsupported_reason(CONFIGS[name]))
        assert build_family(CONFIGS[name]).backup_mode == "cpu_tensor"
        with pytest.raises(ConfigError, match="no host_pool retraction backup"):
            build_family(CONFIGS[name], backup_mode="host_pool")

    @pytest.mark.parametrize("name", ["mla", "mla-ps4"])
    def test_mla_is_backed_up_into_its_host_pool_when_asked(self, api, name):
        """SGLang infers host_pool only for MHA/SWA pools; asked, it backs MLA up into MLATokenToKVPoolHost."""
        from poolfuzz.adapters.sglang import build_family, unsupported_reason

        if unsupported_reason(CONFIGS[name]):
            pytest.skip(unsupported_reason(CONFIGS[name]))
        assert build_family(CONFIGS[name]).backup_mode == "cpu_tensor"
        fam = _family(api, CONFIGS[name], backup_mode="host_pool")
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        assert isinstance(fam.host_pools["host.full"].owner, MLATokenToKVPoolHost)
        assert {c.name for c in fam.host_components()} == {"host.mla.latent", "host.mla.rope"}
        req = _served(fam, 1, 7)
        dev = fam.sg_kv_pool.kv_buffer[0]
        slots = fam.sg_req_pool.req_to_token[req.req_pool_idx, :7].to(torch.int64)
        dev[slots] = torch.arange(1, 8, dtype=dev.dtype)[:, None, None]
        want = dev[slots].clone()
        fam.protocol.retract(req, fam)
        dev.zero_()
        fam.protocol.resume(req, fam)
        slots = fam.sg_req_pool.req_to_token[req.req_pool_idx, :7].to(torch.int64)
        assert torch.equal(fam.sg_kv_pool.kv_buffer[0][slots], want)

    def test_mla_host_pool_passes_the_harness(self, api, fuzz):
        from poolfuzz.adapters.sglang import build_family, unsupported_reason
        from tests.engine_fuzz import fuzz_family

        if unsupported_reason(CONFIGS["mla"]):
            pytest.skip(unsupported_reason(CONFIGS["mla"]))
        _family(api, CONFIGS["mla"], backup_mode="host_pool")  # skips a release without the path

        def host_pool_family(config, **kwargs):
            return build_family(config, **{**kwargs, "backup_mode": "host_pool"})

        outcome = fuzz_family(host_pool_family, CONFIGS["mla"], examples=15, steps=30)
        assert outcome.failure is None, outcome.failure

    def test_a_forked_request_transferred_to_decode_is_stored_in_l3_under_its_own_tokens(self, api):
        """Shrunk from a failure the MLA host-pool fuzz found (the adapter's, not SGLang's): a fork's first token is
        its source's, so its L3 page is the source's page. The decode node made up the fork's ids after a PD
        transfer, so the page was keyed, and audited, as the fork's own; the ids now travel with the request, as a
        decode server receives its prompt."""
        from poolfuzz.adapters.sglang import build_family
        from poolfuzz.harness.engine import Engine

        _family(api, CONFIGS["mla"], backup_mode="host_pool")  # skips a release without the path

        def host_pool_family(config, **kwargs):
            return build_family(config, **{**kwargs, "backup_mode": "host_pool"})

        e = Engine(config=CONFIGS["mla"], family_factory=host_pool_family)
        if e.caps["decode"].take_stored_pages is None:
            pytest.skip(f"sglang {api.version}: no L3 storage tier on this path")
        first = e.admit(1)
        e.prefill(first, 1)
        source = e.admit(1)
        e.prefill(source, 1)
        e.finish(first)
        fork = e.fork(source, 1)
        e.prefill(fork, 1)
        e.finish(source)
        assert e.transfer(fork)
        e.check()
        e.finish(fork)  # its pages go to L3 on the decode node, and are audited there
        e.check()
        e.drain()

    def test_cpu_tensor_is_still_driven_when_asked(self, api):
        fam = _family(api, CONFIGS["dense"], backup_mode="cpu_tensor")
        assert fam.backup_mode == "cpu_tensor" and fam.host_pools == {}


class TestBackup:
    @pytest.mark.parametrize("name", HOST)
    def test_retract_and_resume_round_trip_through_the_host_pool(self, api, name):
        fam = _family(api, CONFIGS[name])
        req = _served(fam, 1, 9)
        pool = getattr(fam.sg_kv_pool, "full_kv_pool", fam.sg_kv_pool)
        slots = fam.sg_req_pool.req_to_token[req.req_pool_idx, :9].to(torch.int64)
        pool.k_buffer[0][slots] = torch.arange(1, 10, dtype=pool.k_buffer[0].dtype)[:, None, None]
        want = _device_rows(fam, req, 9)
        host = fam.host_pools["host.full"]
        fam.protocol.retract(req, fam)
        backup = req.retraction_backup
        assert backup.mode == "host_pool" and backup.num_tokens == req.seqlen - 1
        full = backup.host_transfers[0]
        assert full.space == "host.full" and full.num_tokens == 9
        assert torch.equal(host.owner.k_buffer[0][full.host_indices[:9]], want[0])
        ps = fam.config.page_size
        assert host.available_size() == fam.config.host_size - -(-9 // ps) * ps  # padded to whole pages
        pool.k_buffer[0].zero_()  # whatever reuses the freed device slots
        fam.protocol.resume(req, fam)
        assert torch.equal(_device_rows(fam, req, 9)[0], want[0])
        assert host.available_size() == fam.config.host_size  # the load-back frees the host slots

    def test_abort_of_a_retracted_request_frees_its_host_slots(self, api):
        fam = _family(api, CONFIGS["swa"])
        req = _served(fam, 1, 12)
        fam.protocol.retract(req, fam)
        assert {t.space for t in req.retraction_backup.host_transfers} == {"host.full", "host.swa"}
        fam.protocol.abort(req, fam)
        assert {s: v.available_size() for s, v in fam.host_pools.items()} == {
            "host.full": fam.config.host_size, "host.swa": fam.config.host_size}

    def test_a_full_host_pool_aborts_before_anything_is_released(self, api):
        """SGLang's backup_kv_cache returns None (release_req then aborts): no host slot is kept and the
        request still holds its device slots."""
        config = CONFIGS["dense"].replace(name="dense-host4", host_tokens=4)
        fam = _family(api, config)
        req = _served(fam, 1, 9)
        before = {s: v.available_size() for s, v in fam.free_lists().items()}
        with pytest.raises(PoolExhausted) as info:
            fam.protocol.retract(req, fam)
        assert info.value.space == "host.full"
        assert {s: v.available_size() for s, v in fam.free_lists().items()} == before

    def test_a_host_copy_that_loses_a_layer_is_reported(self, api, monkeypatch, fuzz):
        """The host rows are checksummed components: a write-back that skips the last layer is caught."""
        import sglang.srt.mem_cache.pool_host.mha as host_mha

        from poolfuzz.adapters.sglang.host_tier.host import cpu_transfer_kv_direct

        # dense-ps4: its retraction host pools take the direct copies (retraction_io_backend)
        _family(api, CONFIGS["dense-ps4"])  # installs the CPU copy where it is missing
        def drops_last_layer(*, src_layers, dst_layers, src_indices, dst_indices, page_size):
            cpu_transfer_kv_direct(src_layers[:-1], dst_layers[:-1], src_indices, dst_indices, page_size)

        monkeypatch.setattr(host_mha, "transfer_kv_direct", drops_last_layer)
        outcome = fuzz(CONFIGS["dense-ps4"], examples=30, shrink=False)
        exc = outcome.failure
        assert exc is not None and type(exc).__name__ == "StateLost", exc
        assert exc.divergence.component.startswith("host.full."), exc

    def test_a_kernel_write_back_that_loses_a_layer_is_reported(self, api, monkeypatch, fuzz):
        """Page size 1 retracts through the kernel backend (SGLang's default): the same defect in its
        all-layer copy is caught."""
        import sglang.srt.mem_cache.pool_host.mha as host_mha

        from poolfuzz.adapters.sglang.host_tier.host import retraction_io_backend
        from poolfuzz.adapters.sglang.host_tier.kernel_io import transfer_kv_all_layer

        assert retraction_io_backend(CONFIGS["dense"]) == "kernel"
        _family(api, CONFIGS["dense"])  # installs the CPU copies where they are missing

        def drops_last_layer(*, num_layers, **kw):
            transfer_kv_all_layer(num_layers=num_layers - 1, **kw)

        monkeypatch.setattr(host_mha, "transfer_kv_all_layer", drops_last_layer)
        outcome = fuzz(CONFIGS["dense"], examples=30, shrink=False)
        exc = outcome.failure
        assert exc is not None and type(exc).__name__ == "StateLost", exc
        assert exc.divergence.component.startswith("host.full."), exc
