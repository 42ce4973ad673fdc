"""The serving protocol over every built-in config: admit, extend, evict, retract, resume restores every component."""

import pytest
import torch

from poolfuzz.pools import CONFIGS, ConfigError, PoolExhausted, build_family, uses_ssm_state
from poolfuzz.pools.faults import FAULTS, applicable_configs
from poolfuzz.pools.protocol import ServingProtocol, floor_page
from poolfuzz.pools.request import ReqKv

from pool_patterns import carried, pattern, rows_of

POISON = 253  # scribbled into freed rows; patterns only use 1..250
SEQLEN = 23  # 22 committed positions: past every sliding window, not page-aligned


def host_pool_possible(name: str) -> bool:
    """No recurrent state, and KV the host pool mirrors (plain K and V rows: not MLA, DSA, scaled or FP4) beside full
    attention (SGLang's host-pool retraction rejects an all-SWA model)."""
    config = CONFIGS[name]
    return (not uses_ssm_state(config) and config.attention == "mha" and not config.kv_scale_block
            and config.kv_quant != "fp4_mx_block16" and config.has_full)


def modes_of(name: str) -> list[str]:
    """cpu_tensor always; host_pool only where a host pool can hold the model's state."""
    return ["cpu_tensor"] + (["host_pool"] if host_pool_possible(name) else [])


CASES = [pytest.param(name, mode, id=f"{name}-{mode}") for name in CONFIGS for mode in modes_of(name)]
MAMBA_CONFIGS = [name for name, c in CONFIGS.items() if c.has_mamba]
SWA_SSM_CONFIGS = [name for name, c in CONFIGS.items() if c.has_swa and c.has_mamba]


# --- traceable contents ---------------------------------------------------------------------
def write_request(family, req: ReqKv, n: int) -> None:
    """Write the request's pattern into every component row it owns for positions [0, n)."""
    for i, comp in enumerate(carried(family)):
        pos, rows = rows_of(family, comp, req, list(range(n)))
        comp.tensor[comp.at(torch.tensor(rows))] = pattern(i, req.rid, pos, comp.row_shape, comp.tensor.dtype)


def mismatches(family, req: ReqKv, n: int) -> list[str]:
    """Components whose rows differ from the request's pattern: full [0, n), SWA in the window, mamba."""
    window_start = max(0, n - family.config.sliding_window) if family.config.has_swa else 0
    bad = []
    for i, comp in enumerate(carried(family)):
        positions = list(range(window_start if comp.space == "swa" else 0, n))
        pos, rows = rows_of(family, comp, req, positions)
        if comp.space == "swa" and pos != positions:
            bad.append(f"{comp}: window positions {sorted(set(positions) - set(pos))} unmapped")
            continue
        want = pattern(i, req.rid, pos, comp.row_shape, comp.tensor.dtype)
        if not torch.equal(comp.tensor[comp.at(torch.tensor(rows))], want):
            bad.append(repr(comp))
    return bad


def free_slots(alloc) -> torch.Tensor:
    pages = torch.tensor(alloc.free_pages(), dtype=torch.int64)
    return (pages[:, None] * alloc.page_size + torch.arange(alloc.page_size)).reshape(-1)


def scribble_freed(family) -> None:
    """Write POISON into every free device slot of every component, as another owner would."""
    lists = family.free_lists()
    for comp in carried(family):
        comp.tensor[comp.at(free_slots(lists[comp.space]))] = POISON


def full_availability(family) -> dict[str, int]:
    return family.config.device_capacity()


def availability(family, *, host: bool = False) -> dict[str, int]:
    return {space: a.available_size() for space, a in family.free_lists().items()
            if host or not space.startswith("host.")}


def admit_and_fill(family, rid: int = 1, seqlen: int = SEQLEN) -> ReqKv:
    """A decoding request: seqlen-1 positions of KV written, a cleared-then-written mamba slot, SWA evicted."""
    p = family.protocol
    req = ReqKv(rid=rid, seqlen=seqlen)
    n = seqlen - 1
    p.admit(req, family)
    p.extend(req, family, n)
    p.run_deferred_mamba_ops([req], family)
    req.kv_committed_len = n
    write_request(family, req, n)
    if family.config.has_swa:  # SGLang evicts only on SWA models; the call assumes an SWA allocator
        p.evict_swa(req, family, pre_len=n)
    return req


# --- the round trip -------------------------------------------------------------------------
class TestRetractResumeRoundTrip:
    @pytest.mark.parametrize(("name", "mode"), CASES)
    def test_resume_restores_every_component(self, name, mode):
        """Retract frees everything, freed rows are scribbled, and resume restores KV, the SWA window and the state."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode=mode)
        p = family.protocol
        req = admit_and_fill(family)
        n = SEQLEN - 1
        assert mismatches(family, req, n) == []
        c = family.config
        if c.has_swa:
            assert req.swa_evicted_seqlen == floor_page(n - c.sliding_window, c.page_size)

        p.retract(req, family)
        assert (req.req_pool_idx, req.mamba_pool_idx, req.kv_allocated_len, req.retraction_count) == (None, None, 0, 1)
        assert req.swa_evicted_seqlen == 0
        backup = req.retraction_backup
        assert (backup.mode, backup.num_tokens) == (mode, n)
        assert availability(family) == full_availability(family)

        scribble_freed(family)
        p.resume(req, family)
        assert req.retraction_backup is None
        assert (req.kv_allocated_len, req.kv_committed_len) == (n, n)
        assert mismatches(family, req, n) == []
        if mode == "host_pool":
            assert all(h.available_size() == c.host_size for h in family.host_pools.values())

    @pytest.mark.parametrize(("name", "mode"), CASES)
    def test_retracting_one_request_leaves_another_intact(self, name, mode):
        """A bystander keeps its contents across another request's retract, scribble and resume."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode=mode)
        victim = admit_and_fill(family, rid=1)
        bystander = admit_and_fill(family, rid=2, seqlen=9)
        family.protocol.retract(victim, family)
        scribble_freed(family)
        family.protocol.resume(victim, family)
        assert mismatches(family, victim, SEQLEN - 1) == []
        assert mismatches(family, bystander, 8) == []

    @pytest.mark.parametrize(("name", "mode"), CASES)
    def test_release_after_resume_returns_everything(self, name, mode):
        """Releasing a resumed request brings every device allocator back to full availability."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode=mode)
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        family.protocol.resume(req, family)
        family.protocol.release_kv(req, family)
        assert availability(family) == full_availability(family)


class TestRetractionBackupMamba:
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_state_is_backed_up_exactly_once(self, name):
        """mamba_cpu is set iff the model has state and its KV pool does not carry it; the KV copy carries it otherwise."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode="cpu_tensor")
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        backup = req.retraction_backup
        carries = type(family.kv_pool).cpu_copy_carries_mamba
        in_kv_copy = getattr(backup.cpu_tensors, "mamba", None) is not None
        in_mamba_cpu = backup.mamba_cpu is not None
        if family.config.has_mamba:
            assert (in_kv_copy, in_mamba_cpu) == (carries, not carries)
        else:
            assert (in_kv_copy, in_mamba_cpu) == (False, False)
        assert ("mamba_cpu=yes" in repr(backup)) == in_mamba_cpu

    def test_swa_ssm_backs_up_the_state_beside_the_kv_copy(self):
        """swa-ssm: SWAKVPool leaves the state behind, so the caller's mamba_cpu holds it (post-#35957)."""
        family = build_family(CONFIGS["swa-ssm"], device="cpu")
        assert ServingProtocol().mamba_pool_needing_backup(ReqKv(rid=1), family) is None  # no slot held
        req = admit_and_fill(family)
        assert ServingProtocol().mamba_pool_needing_backup(req, family) is family.req_pool.mamba_pool
        family.protocol.retract(req, family)
        assert req.retraction_backup.mamba_cpu is not None
        assert set(vars(req.retraction_backup.cpu_tensors)) == {"full", "swa", "swa_mask"}

    @pytest.mark.parametrize("name", ["dense", "swa"])
    def test_host_pool_backup_has_no_mamba(self, name):
        """host_pool backups hold host transfers only, one per sub-pool."""
        family = build_family(CONFIGS[name], device="cpu", backup_mode="host_pool")
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        backup = req.retraction_backup
        assert backup.mamba_cpu is None and backup.cpu_tensors is None
        assert [t.space for t in backup.host_transfers] == (["host.full", "host.swa"] if name == "swa" else ["host.full"])


class TestFaultSwaIgnoresMambaBackup:
    @pytest.mark.parametrize("name", SWA_SSM_CONFIGS)
    def test_fault_loses_the_recurrent_state(self, name):
        """With the pre-#35957 caller the resumed request's mamba slot holds a previous owner's data."""
        family = build_family(CONFIGS[name], device="cpu", faults=["swa-ignores-mamba-backup"])
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        assert req.retraction_backup.mamba_cpu is None
        scribble_freed(family)
        family.protocol.resume(req, family)
        assert all("mamba" in m for m in mismatches(family, req, SEQLEN - 1))
        assert len(mismatches(family, req, SEQLEN - 1)) == len(family.req_pool.mamba_pool.components())
        for comp in family.req_pool.mamba_pool.components():
            assert set(comp.tensor[req.mamba_pool_idx].unique().tolist()) == {POISON}

    def test_swa_ssm_configs_are_the_ones_the_fault_applies_to(self):
        """The fault applies exactly to configs with both SWA and recurrent state."""
        assert applicable_configs("swa-ignores-mamba-backup") == SWA_SSM_CONFIGS == ["swa-ssm", "swa-ssm-ps4"]
        assert repr(FAULTS["swa-ignores-mamba-backup"]) == "Fault(swa-ignores-mamba-backup)"

    @pytest.mark.parametrize("name", [n for n in CONFIGS if n not in SWA_SSM_CONFIGS])
    def test_fault_is_rejected_where_it_does_not_apply(self, name):
        """Switching the fault on for a config without SWA+SSM is a ConfigError naming where it applies."""
        with pytest.raises(ConfigError, match="does not apply to config") as info:
            build_family(CONFIGS[name], device="cpu", faults=["swa-ignores-mamba-backup"])
        assert "swa-ssm, swa-ssm-ps4" in str(info.value)

    def test_unknown_fault_is_rejected(self):
        """An unknown fault id is a ConfigError that lists the known faults."""
        with pytest.raises(ConfigError, match="unknown fault 'no-such-fault'; known faults: swa-ignores-mamba-backup"):
            build_family(CONFIGS["dense"], device="cpu", faults=["no-such-fault"])

    def test_family_records_its_faults(self):
        """The family's repr names the faults it was built with."""
        family = build_family(CONFIGS["swa-ssm"], device="cpu", faults=["swa-ignores-mamba-backup"])
        assert repr(family) == "PoolFamily(swa-ssm, cpu, cpu_tensor, faults=['swa-ignores-mamba-backup'])"


class TestBackupModes:
    @pytest.mark.parametrize("name", MAMBA_CONFIGS)
    def test_host_pool_is_refused_for_recurrent_state(self, name):
        """host_pool cannot carry recurrent state: asking for it is a ConfigError pointing at cpu_tensor."""
        with pytest.raises(ConfigError, match="use backup_mode='cpu_tensor'"):
            build_family(CONFIGS[name], device="cpu", backup_mode="host_pool")

    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_default_backup_mode(self, name):
        """The default is host_pool where a host pool can hold the model's state, cpu_tensor otherwise."""
        family = build_family(CONFIGS[name], device="cpu")
        assert family.backup_mode == ("host_pool" if host_pool_possible(name) else "cpu_tensor")
        assert family.uses_ssm_state == CONFIGS[name].has_mamba

    def test_unknown_backup_mode_is_refused(self):
        """An unknown backup mode is a ConfigError listing the modes."""
        with pytest.raises(ConfigError, match="choose one of cpu_tensor, host_pool"):
            build_family(CONFIGS["dense"], device="cpu", backup_mode="disk")


class TestHostPoolBackupExhaustion:
    @pytest.mark.parametrize(("name", "requested"), [("dense", 22), ("swa-ps4", 24)])
    def test_exhaustion_raises_before_anything_is_released(self, name, requested):
        """A backup that does not fit the host pool raises PoolExhausted and the request keeps everything."""
        config = CONFIGS[name].replace(host_tokens=16)  # 22 positions (24 padded to pages) do not fit
        family = build_family(config, device="cpu", backup_mode="host_pool")
        req = admit_and_fill(family)
        before = availability(family, host=True)
        row, allocated = req.req_pool_idx, req.kv_allocated_len
        with pytest.raises(PoolExhausted) as info:
            family.protocol.retract(req, family)
        assert (info.value.space, info.value.requested, info.value.available) == ("host.full", requested, 16)
        assert availability(family, host=True) == before
        assert (req.req_pool_idx, req.kv_allocated_len, req.retraction_backup, req.retraction_count) == (
            row, allocated, None, 0)
        assert mismatches(family, req, SEQLEN - 1) == []

    def test_discard_frees_the_host_slots(self):
        """discard drops a host_pool backup and returns its host slots."""
        family = build_family(CONFIGS["swa"], device="cpu", backup_mode="host_pool")
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        # 22 positions on host.full; the window [16, 22) on host.swa.
        assert availability(family, host=True)["host.full"] == 128 - 22
        assert availability(family, host=True)["host.swa"] == 128 - 6
        family.protocol.discard(req, family)
        assert req.retraction_backup is None
        assert availability(family, host=True) == {**full_availability(family), "host.full": 128, "host.swa": 128}

    def test_discard_of_cpu_tensor_backup_drops_it(self):
        """discard of a cpu_tensor backup only drops the payload; discarding nothing is a no-op."""
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        req = admit_and_fill(family)
        family.protocol.retract(req, family)
        family.protocol.discard(req, family)
        assert req.retraction_backup is None
        family.protocol.discard(req, family)
        assert availability(family) == full_availability(family)


class TestProtocolSteps:
    def test_admit_flags_a_fresh_mamba_slot_and_extend_clears_it(self):
        """A reused mamba slot keeps stale state until the extend forward's deferred clear."""
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        pool = family.req_pool.mamba_pool
        pool.temporal[:, 1] = 7.0
        req = ReqKv(rid=1, seqlen=4)
        family.protocol.admit(req, family)
        assert (req.req_pool_idx, req.mamba_pool_idx, req.mamba_needs_clear) == (1, 1, True)
        assert float(pool.temporal[:, 1].min()) == 7.0
        family.protocol.run_deferred_mamba_ops([req], family)
        assert not req.mamba_needs_clear
        assert not pool.temporal[:, 1].any()

    def test_deferred_copy_on_write_wins_over_clear(self):
        """A request with a COW source gets the source's state, not zeros."""
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        pool = family.req_pool.mamba_pool
        checkpoint = family.req_pool.mamba_allocator.alloc_one()  # a prefix-tree slot: 1
        pool.temporal[:, checkpoint] = 3.0
        req = ReqKv(rid=1, seqlen=4)
        family.protocol.admit(req, family)
        req.mamba_cow_src = checkpoint
        family.protocol.run_deferred_mamba_ops([req], family)
        assert req.mamba_cow_src is None
        assert set(pool.temporal[:, req.mamba_pool_idx].unique().tolist()) == {3.0}

    def test_admit_gives_the_row_back_when_mamba_slots_run_out(self):
        """The fifth admit of hybrid-linear (4 mamba slots, 5 rows) raises and keeps no row."""
        family = build_family(CONFIGS["hybrid-linear"], device="cpu")
        for rid in range(4):
            family.protocol.admit(ReqKv(rid=rid), family)
        req = ReqKv(rid=9)
        with pytest.raises(PoolExhausted) as info:
            family.protocol.admit(req, family)
        assert info.value.space == "mamba"
        assert req.req_pool_idx is None
        assert family.req_pool.available_size() == 1

    def test_extend_writes_slots_into_the_request_row(self):
        """Two extends of a dense-ps4 request continue the same page and record every slot."""
        family = build_family(CONFIGS["dense-ps4"], device="cpu")
        req = ReqKv(rid=1)
        family.protocol.admit(req, family)
        assert family.protocol.extend(req, family, 3).tolist() == [4, 5, 6]
        assert family.protocol.extend(req, family, 6).tolist() == [7, 8, 9]
        assert family.req_pool.read(req.req_pool_idx, 0, 6).tolist() == [4, 5, 6, 7, 8, 9]

    def test_evict_swa_advances_by_whole_pages(self):
        """swa-ps4 (window 6): at pre_len 22 positions [0, 16) leave the window, four SWA pages freed."""
        family = build_family(CONFIGS["swa-ps4"], device="cpu")
        req = ReqKv(rid=1, seqlen=23)
        family.protocol.admit(req, family)
        family.protocol.extend(req, family, 22)
        before = family.allocator.swa_available_size()
        family.protocol.evict_swa(req, family, pre_len=22)
        assert req.swa_evicted_seqlen == 16  # floor_page(22 - 6)
        assert family.allocator.swa_available_size() == before + 16
        family.protocol.evict_swa(req, family, pre_len=22)  # nothing new slid out
        assert family.allocator.swa_available_size() == before + 16

    def test_pre_alloc_is_all_or_nothing(self):
        """A pre_alloc that cannot get its KV returns the row and the mamba slot it took."""
        family = build_family(CONFIGS["swa-ssm"], device="cpu")
        req = ReqKv(rid=1)
        with pytest.raises(PoolExhausted) as info:
            family.protocol.pre_alloc(req, family, fill_len=40)  # SWA pool holds 32
        assert info.value.space == "swa"
        assert (req.req_pool_idx, req.mamba_pool_idx) == (None, None)
        assert availability(family) == full_availability(family)
