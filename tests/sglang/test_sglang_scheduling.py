"""SGLang's own batch scheduling on the CPU, fed by the model-runner stand-in
(adapters/sglang/scheduler/scheduling.py, issue 31).

SGLang decides everything (which requests are batched, chunks, tree hits, retraction, which slots); the runner
checks, before every forward, that each position a request attends to holds the KV of its own tokens up to it.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.adapters.sglang import compat
from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.errors import ConfigError
from tests.sglang.families import release as _release

SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


def _fuzz(scheduling, name, drivers=None, *, observer=None, **kw):
    _skip_if_declined(scheduling, name)  # a config the release's server refuses or lacks is no server to fuzz

    def driver(config):
        d = scheduling.SglangSchedulerDriver(config)
        if drivers is not None:
            drivers.append(d)
        return d

    run_state_machine_as_test(scheduled_machine(CONFIGS[name], driver_factory=driver, observer=observer),
                              settings=settings(SETTINGS, **kw))


def test_the_real_scheduler_keeps_every_request_on_its_own_kv(scheduling):
    """Chunked prefills and tree hits happen, and every forward found its context intact."""
    drivers = []
    _fuzz(scheduling, "dense", drivers)
    assert len(drivers) >= 20
    assert sum(d.chunked for d in drivers) > 0  # prompts longer than the chunk size were split by PrefillAdder
    assert sum(d.hits for d in drivers) > 0  # requests joined a batch with a prefix matched in the radix tree


def test_decode_memory_pressure_makes_the_server_retract_and_recompute(scheduling):
    """Three requests of 4 + 14 tokens on a 48-slot pool: PrefillAdder admits all three on its new-token estimate
    (--schedule-conservativeness 0.1), decode runs out of slots, retract_decode takes one back, and it is
    recomputed (its context checked again) once the others finish."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    rids = [driver.add_request(length=4, share=0, max_tokens=14) for _ in range(3)]
    reqs = [driver.requests[rid] for rid in rids]
    for _ in range(60):
        driver.step()
    assert driver.retracted >= 1
    assert any(req.retraction_count for req in reqs)  # taken back, not aborted: recomputed from its tokens
    assert not set(rids) & driver.aborted
    for req in reqs:  # every one ran to its length, the retracted one too, on tokens the runner checked
        assert type(req.finished_reason).__name__ == "FINISH_LENGTH" and len(req.output_ids) == 14, req
    assert driver.drain() is None


def test_a_chunked_prompt_is_shared_before_it_finishes(scheduling):
    """PrefillAdder splits a 20-token prompt at the chunk size (16); the chunk goes into the tree, and a request
    sharing the prompt's first 16 tokens matches them in the very next batch."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    a = driver.add_request(length=20, share=0, max_tokens=3)
    driver.step()
    assert driver.server.chunked_req is driver.requests[a] and driver.chunked == 1
    b = driver.add_request(length=2, share=4, max_tokens=3)  # a's first 16 tokens, then 2 of its own
    driver.step()
    assert driver.first_prefix[b] == 16 and driver.hits == 1
    assert driver.drain() is None


@pytest.mark.parametrize("policy, chunk, size", [("lpm", 0, None), ("dfs-weight", 4, 4), ("lof", 32, 32)])
def test_a_configs_scheduling_flags_are_the_servers(scheduling, policy, chunk, size):
    """A config's scheduling flags (drawn configs draw them) are the server's: SGLang's SchedulePolicy runs its policy,
    and its Scheduler's own init_chunked_prefill reads the chunk size, where --chunked-prefill-size -1 (the config's 0)
    leaves a 20-token prompt unchunked; the server serves on the policy and checks pass."""
    c = CONFIGS["dense"].replace(schedule_policy=policy, chunked_prefill=chunk, conservativeness_pct=100)
    driver = scheduling.SglangSchedulerDriver(c)
    assert driver.server.policy.policy.value == policy and driver.server.chunked_prefill_size == size
    assert driver.server_args["schedule_conservativeness"] == 1.0
    a = driver.add_request(length=20, share=0, max_tokens=3)
    driver.step()
    assert (driver.server.chunked_req is driver.requests[a]) == (size is not None and size < 20)
    driver.add_request(length=2, share=4, max_tokens=3)
    driver.add_request(length=5, share=0, max_tokens=4)
    assert driver.drain() is None


def test_an_aborted_request_leaves_nothing_behind(scheduling):
    """A waiting request is popped and answered at once; a running one finishes with an abort at its next forward,
    short of its max_tokens, and its row and slots go back (SGLang's idle leak checks pass)."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    waiting = driver.add_request(length=3, share=0, max_tokens=4)
    driver.abort(waiting)
    assert waiting in driver.aborted and waiting not in driver.requests
    running = driver.add_request(length=3, share=0, max_tokens=4)
    req = driver.requests[running]
    driver.step()
    driver.abort(running)
    assert driver.live() == [running]
    driver.step()
    assert type(req.finished_reason).__name__ == "FINISH_ABORT" and len(req.output_ids) < 4, req
    assert driver.drain() is None and driver.live() == []


def test_a_prompt_the_server_cannot_hold_is_refused_as_its_front_end_refuses_it(scheduling):
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    refusal = driver.add_request(length=driver.server.max_req_input_len, share=0, max_tokens=1)
    assert driver.refused == 1 and driver.requests[refusal].to_finish is not None  # queued with its abort
    driver.step()  # the server answers it
    assert refusal not in driver.requests
    assert driver.drain() is None


def test_a_slot_handed_out_twice_is_caught_and_named(scheduling, monkeypatch):
    """An allocator that hands out a slot a running request still holds (a double allocation): the victim's next
    forward reads the newcomer's KV, and the report names the request, the slot and whose data it holds."""
    from poolfuzz.pools.errors import LostKv

    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator as allocator_cls

    real = allocator_cls.alloc
    live_rows = {}

    def double_allocating(self, need_size, *args, **kwargs):
        out = real(self, need_size, *args, **kwargs)
        held = live_rows.get(id(self))
        if out is not None and held:
            out = out.clone()
            out[0] = held()
        return out

    monkeypatch.setattr(allocator_cls, "alloc", double_allocating)
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    a = driver.add_request(length=4, share=0, max_tokens=6)
    driver.step()  # a's prompt in slots; from now on every allocation hands out a's first slot again
    req = driver.requests[a]
    row = compat.request_row(req)
    live_rows[id(driver.family.sg_allocator)] = lambda: int(driver.family.sg_req_pool.req_to_token[row, 0])
    b = driver.add_request(length=3, share=0, max_tokens=2)
    with pytest.raises(LostKv) as info:
        for _ in range(6):
            driver.step()
    assert re.match(rf"req \d+ step \d+: full\.[kv] layer \d+ position 0: block \d+ slot \d+ holds req {b}'s position "
                    r"\d+ \(another prefix\)", str(info.value)), info.value


def test_a_slot_freed_while_its_request_runs_is_caught_after_the_step(scheduling):
    """A slot given back to the allocator while a running request still holds it: SGLang's own invariant checker
    (run after every rule) sees the pool over-counted, and the report names the request, the slot and its position
    before any allocation hands it out again."""
    import torch

    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    a = driver.add_request(length=4, share=0, max_tokens=6)
    driver.step()
    assert driver.state_problem() is None
    req = driver.requests[a]
    slot = int(driver.family.sg_req_pool.req_to_token[compat.request_row(req), 2])
    driver.family.sg_allocator.free(torch.tensor([slot], dtype=torch.int64))
    problem = driver.state_problem()
    # SGLang's own checker: one slot more than the pool holds is accounted (its use-after-free check comes next)
    assert problem.startswith("Full Pool Mem Leak Detected! [full] total=48, available=45"), problem
    if compat.requests_owning_rows(driver.server):  # the release's checker lists who holds rows (0.5.23): named
        assert problem.endswith(f"; req {a} holds slot {slot} (page {slot}) at position 2, listed free"), problem
    else:  # before 0.5.23 the checker keeps no such list, and the message names no holder
        assert "holds slot" not in problem, problem


def test_an_aborted_chunked_prefill_is_answered_and_released(scheduling):
    """A 17-token prompt is mid-prefill (chunked at 16) when it is aborted: abort_request only marks it, the next
    scheduling step releases its row and slots and answers the abort (found by the fuzzer as a false 'unfinished'
    verdict while the driver only forgot requests after a step that ran a batch)."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dense"])
    a = driver.add_request(length=17, share=0, max_tokens=1)
    driver.step()
    assert driver.server.chunked_req is driver.requests[a]
    driver.abort(a)
    driver.step()
    assert a in driver.aborted and a not in driver.requests
    assert driver.drain() is None


# --- paged pools and recurrent state (mamba no_buffer and extra_buffer) ---------------------------------------------
@pytest.mark.parametrize("name", ["dense-ps4", "hybrid-linear", "hybrid-extra-buffer", "hybrid-extra-buffer-ps4", "swa",
                                  "swa-ps4", "swa-ssm", "swa-only"])
def test_paged_and_recurrent_servers_keep_every_request_on_its_own_state(scheduling, api, name):
    """Fuzzed through SGLang's own scheduler: prefix hits happen (on a mamba model, on a tracked or cached state) and
    every forward found its KV and the state it continues from intact. The release's judged defects through the
    scheduler are passed over (0.5.18 to 0.5.22: swa-ps4's window off the page grid, ci/known/sglang-0.5.18-0.5.22.txt,
    anchored in test_sglang_scheduling_swa_window.py)."""
    from tests.judged import PassOverJudged

    drivers = []
    judged = PassOverJudged("sglang", api.version, name, family="sglang:scheduler")
    _fuzz(scheduling, name, drivers, observer=judged, max_examples=15)
    assert sum(d.hits for d in drivers) > 0
    assert sum(d.chunked for d in drivers) > 0


def _hit_after_a_prefill(scheduling, name):
    """Two 10-token prompts prefilled and decoded; then a request sharing the first one's first 12 tokens."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS[name])
    first = driver.add_request(length=10, share=0, max_tokens=7)
    driver.add_request(length=10, share=0, max_tokens=7)
    for _ in range(12):
        driver.step()
    late = driver.add_request(length=3, share=3, max_tokens=4)
    return driver, first, late


@pytest.mark.parametrize("name", ["hybrid-linear", "hybrid-extra-buffer"])
def test_a_mamba_prefix_hit_continues_from_the_prefix_state(scheduling, name):
    """The tree holds a state of the shared prompt (no_buffer: the one its prefill ended on; extra_buffer: one the
    kernels snapshot at a track boundary); the late request matches at least 8 of its tokens, and its forward checks
    its working slot holds exactly the state of the tokens matched, copied from the tree (SGLang's deferred
    copy-on-write)."""
    driver, _, late = _hit_after_a_prefill(scheduling, name)
    assert driver.drain() is None
    assert driver.first_prefix[late] >= 8


def test_a_skipped_copy_on_write_is_caught_and_named(scheduling):
    """A model runner that does not run the deferred copy-on-write before the forward: the hitting request starts
    from a slot nobody wrote, and the report names the request, the mamba component, the slot, the last position the
    state should cover and what the slot holds."""
    from poolfuzz.pools.errors import LostKv

    driver, _, late = _hit_after_a_prefill(scheduling, "hybrid-extra-buffer")
    driver.runner.cow_and_clear = lambda batch: None
    with pytest.raises(LostKv) as info:
        driver.drain()
    hit = driver.first_prefix[late]
    assert re.match(rf"req {late} step \d+: mamba\.\w+ layer \d+ position {hit - 1}: block \d+ slot \d+ holds zeros",
                    str(info.value)), info.value


def test_a_snapshot_of_the_whole_extend_is_caught_as_another_length(scheduling):
    """A kernel stand-in that snapshots the state at the end of the extend, not at the track boundary SGLang's
    ``mamba_track_aligned_lens`` names: the tree files a 10-token state as the state of 8 tokens, and the hit reads
    it (found as a mistake of this runner before it called SGLang's own length)."""
    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SglangSchedulerDriver(CONFIGS["hybrid-extra-buffer"])
    driver.runner.aligned_lens = lambda mask, seqlens, prefix, extend_lens: seqlens - prefix
    first = driver.add_request(length=10, share=0, max_tokens=7)
    for _ in range(10):
        driver.step()
    late = driver.add_request(length=3, share=3, max_tokens=4)
    with pytest.raises(LostKv) as info:
        driver.drain()
    assert re.match(rf"req {late} step \d+: mamba\.\w+ layer \d+ position 7: block \d+ slot \d+ holds the state "
                    rf"after req {first}'s position 9 \(another prefix\)", str(info.value)), info.value


def test_a_paged_mamba_server_without_the_extra_buffer_is_refused_with_sglangs_reason(scheduling):

    # SGLang's validation of the flags refuses it where its configurator builds the pools (0.5.22 on), its tree's
    # MambaComponent where not, and the MambaRadixCache itself before that component (0.5.15 and earlier)
    with pytest.raises(ConfigError, match="no_buffer only supports page_size=1|MambaComponent requires page_size=1 "
                                          "when mamba_extra_buffer is disabled|Page size must be 1 for MambaRadixCache"):
        scheduling.SglangSchedulerDriver(CONFIGS["hybrid-linear-ps4"])


def test_a_sliding_window_row_lost_inside_the_window_is_caught_and_named(scheduling):
    """SWA layers are checked over the positions the next token's window reads, at the SWA slot the pool's own
    translation gives: a sliding-window K row cleared under a running request is reported with its layer and slot."""
    import torch

    driver = scheduling.SglangSchedulerDriver(CONFIGS["swa"])
    a = driver.add_request(length=6, share=0, max_tokens=6)
    driver.step()
    req = driver.requests[a]
    row = compat.request_row(req)
    full_slot = driver.family.sg_req_pool.req_to_token[row, 5:6].to(dtype=torch.int64)
    swa_slot = int(driver.family.sg_kv_pool.translate_loc_from_full_to_swa(full_slot)[0])
    swa_k = next(c for c, _ in driver.runner.kv if c.name == "swa.k")
    swa_k.tensor[swa_slot].zero_()
    from poolfuzz.pools.errors import LostKv

    with pytest.raises(LostKv) as info:
        driver.step()
    assert str(info.value).startswith(f"req {a} step 2: swa.k layer {swa_k.layer} position 5: block {swa_slot} slot "
                                      f"{swa_slot} holds zeros"), info.value


def test_a_release_without_the_runner_s_mamba_functions_declines_mamba_models(scheduling, monkeypatch):
    """The stand-in calls SGLang's deferred copy-on-write and its snapshot length; where a release lacks one, a
    mamba model is declined naming it (never fuzzed with a guess), and a dense one still runs."""

    monkeypatch.setattr(compat, "mamba_track_aligned_lens", lambda model_chunk=64: None)
    with pytest.raises(ConfigError, match="has no ForwardBatch.mamba_track_aligned_lens or MambaAttnBackendBase."
                       "_init_track_ssm_indices, which the model-runner"):
        scheduling.SglangSchedulerDriver(CONFIGS["hybrid-extra-buffer"])
    assert scheduling.SglangSchedulerDriver(CONFIGS["dense"]).runner.aligned_lens is None


def test_state_slots_sized_inline_are_found_by_building_the_fewest_that_keep_the_rows(scheduling, monkeypatch):
    """0.5.9's runner sizes a mamba model's rows inline from its state slots (no ratio to call): the slots are found by
    builds, each answered by the build itself (here a stand-in keeping a row for every 3 slots), doubled until the
    config's rows are kept, then bisected to the fewest; found once per config and server; refused, saying so, when no
    number of slots keeps them."""
    from types import SimpleNamespace as NS

    from poolfuzz.adapters.sglang.scheduler import scheduling_global

    monkeypatch.setattr(scheduling_global, "_INLINE_SLOTS", {})
    config = CONFIGS["hybrid-linear"].replace(mamba_slots=4, request_rows=5)
    tried = []

    def build(trial, rows_per_slot=3):
        tried.append(trial.mamba_slots)
        return NS(sg_req_pool=NS(size=min(5, trial.mamba_slots // rows_per_slot)), slots=trial.mamba_slots)

    sized, family = scheduling_global.inline_mamba_sized(config, build, server="flags")
    assert (sized.mamba_slots, family.slots) == (15, 15)
    assert tried == [4, 8, 16, 12, 14, 15]
    tried.clear()
    assert scheduling_global.inline_mamba_sized(config, build, server="flags")[0].mamba_slots == 15 and tried == [15]
    roomy = config.replace(mamba_slots=20)  # enough already: built once, as given
    assert scheduling_global.inline_mamba_sized(roomy, build, server="flags")[0].mamba_slots == 20
    with pytest.raises(ConfigError, match="keeps fewer than 5 request rows with 128 mamba state slots"):
        scheduling_global.inline_mamba_sized(config, lambda trial: build(trial, rows_per_slot=100), server="other")


def test_a_release_sizing_state_slots_inline_runs_mamba_servers_on_the_slots_its_runner_keeps_rows_for(scheduling):
    """0.5.9: ``hybrid-linear``'s server is the one whose ``init_memory_pool`` keeps its 5 request rows, 15 state
    slots (a row for every 3). Its first batch meets 0.5.9's judged busy-check defect (fixed in 0.5.11,
    ``ci/known/sglang-0.5.9-0.5.15.txt``): the strict check asks the mamba tree's ``evictable_size``, which raises
    bare, and the report says where."""
    from poolfuzz.harness.failures import message_of

    if compat.has_private("runner_mamba_ratio") or compat.has_private("calculate_mamba_ratio"):
        pytest.skip("this release has a mamba ratio to ask (0.5.10 on): its slots are sized by it")
    driver = scheduling.SglangSchedulerDriver(CONFIGS["hybrid-linear"])
    assert driver.config.mamba_slots == 15 and driver.family.sg_req_pool.size == 5
    assert driver.family.sg_req_pool.mamba_pool.size == 15
    driver.add_request(length=6, share=0, max_tokens=2)
    driver.step()
    with pytest.raises(NotImplementedError) as raised:
        driver.state_problem()  # the checks the harness runs after each step, the strict busy check among them
    assert re.search(r"raised without a message in sglang/srt/mem_cache/mamba_radix_cache.py:\d+ evictable_size, "
                     r"called from sglang/srt/managers/\w+.py:\d+ _get_token_info", message_of(raised.value))


# --- every KV layout the family builds: MLA, quantised K and V with their scales, sparse indexes -------------------
KV_KINDS = ["mla", "mla-ps4", "fp8-scaled", "dense-cpu-fp8", "dense-fp4", "mla-fp4", "minimax-sparse",
            "minimax-sparse-konly-ps4", "mla-ssm"]


def _skip_if_declined(scheduling, name):
    from poolfuzz.adapters.sglang.scheduler import servers

    reason = servers.unsupported_reason(CONFIGS[name])
    if reason:
        pytest.skip(f"this release declines {name}: {reason}")


@pytest.mark.parametrize("name", KV_KINDS)
def test_every_kv_layout_is_scheduled_by_sglang_and_kept_on_its_own_tokens(scheduling, name):
    """MLA latents, FP8 and FP4 bytes with their scale rows, MiniMax's and DSA's index caches: each component of each
    layer is written at the batch's ``out_cache_loc`` and checked before every forward, through SGLang's scheduler."""
    _skip_if_declined(scheduling, name)
    drivers = []
    _fuzz(scheduling, name, drivers, max_examples=10)
    assert sum(d.hits for d in drivers) > 0
    assert sum(d.chunked for d in drivers) > 0


# (config, component): one component of each kind the pool's door does not write as K and V
LOST_COMPONENTS = [("mla", "mla.latent"), ("mla", "mla.rope"), ("fp8-scaled", "full.k_scale"),
                   ("dense-fp4", "full.v_scale"), ("mla-fp4", "mla.scale"), ("minimax-sparse", "msa.index_k"),
                   ("dsa-ps64", "dsa.index_k")]


@pytest.mark.parametrize("name,component", LOST_COMPONENTS)
def test_a_lost_row_of_any_kv_component_is_caught_and_named(scheduling, name, component):
    """A row of the component cleared under a running request (for DSA's page-major index cache, the row inside its
    page): the next forward reports the request, the component, its layer, the position and the slot."""
    import torch

    from poolfuzz.pools.errors import LostKv

    _skip_if_declined(scheduling, name)
    driver = scheduling.SglangSchedulerDriver(CONFIGS[name])
    a = driver.add_request(length=6, share=0, max_tokens=6)
    driver.step()
    row = compat.request_row(driver.requests[a])
    slot = int(driver.family.sg_req_pool.req_to_token[row, 5:6].to(dtype=torch.int64)[0])
    comp = next(c for c, _ in driver.runner.kv if c.name == component)
    comp.tensor[comp.at(slot)].zero_()
    with pytest.raises(LostKv) as info:
        driver.step()
    assert str(info.value).startswith(f"req {a} step 2: {component} layer {comp.layer} position 5: block {slot} slot "
                                      f"{slot} holds zeros"), info.value


def test_mla_rows_go_through_the_pools_own_write_door(scheduling, monkeypatch):
    """The latent and rope parts are handed to ``set_kv_buffer`` as an MLA backend hands them: a door that drops
    the write leaves the request's context unwritten, and the next forward says so."""
    from poolfuzz.pools.errors import LostKv

    driver = scheduling.SglangSchedulerDriver(CONFIGS["mla"])
    monkeypatch.setattr(type(driver.family.sg_kv_pool), "set_kv_buffer", lambda self, *a, **k: None)
    a = driver.add_request(length=6, share=0, max_tokens=6)
    driver.step()
    with pytest.raises(LostKv, match=rf"req {a} step 2: mla\.(latent|rope) layer \d+ position 0: .* holds zeros"):
        driver.step()


@pytest.mark.anchored
def test_a_prompt_within_a_page_of_the_pool_is_accepted_but_never_admitted(scheduling, api):
    """sglang#39271 (open; fix proposed in #39272), as the fuzzer found it on dsa-ps64 (64-token pages, a 256-token
    pool and context, so max_req_input_len 250): a 192-token prompt passes validate_input_length, and
    init_req_max_new_tokens clips its max_new_tokens to 0, since the base allocator's max_new_tokens_for_memory floors
    the empty-pool budget 256 - 192 - 64 - 1 at 0 where its docstring promises None ("prompt cannot fit", which the
    Scheduler answers with an abort). PrefillAdder then wants prompt + 0 + one page strictly below the free pool
    (192 + 0 + 64 < 256) and never admits it: the request waits forever on an idle server (every prompt of 192 to 249
    tokens here). One token shorter, it is admitted and finishes. Before 0.5.22 the refusal also leaves the empty running
    batch marked full (sglang#22518). 0.5.10 has no such clip: the prompt is given its one new token and finishes."""
    from packaging.version import Version

    from poolfuzz.pools.errors import ServerStuck

    if _release(api) == Version("0.5.11"):
        pytest.skip("0.5.11 does not clip the one new token yet, and never admits the 191-token prompt either (seen at "
                    "stop 62: it waits with the running batch marked full, sglang#22518); its boundary not searched")
    fits = scheduling.SglangSchedulerDriver(CONFIGS["dsa-ps64"])
    rid = fits.add_request(length=191, share=0, max_tokens=1)
    assert fits.drain() is None and fits.outcome[rid] == "finished"

    driver = scheduling.SglangSchedulerDriver(CONFIGS["dsa-ps64"])
    rid = driver.add_request(length=192, share=0, max_tokens=1)
    if _release(api) < Version("0.5.11"):
        assert driver.requests[rid].sampling_params.max_new_tokens == 1
        assert driver.drain() is None and driver.outcome[rid] == "finished"
        return
    assert driver.requests[rid].sampling_params.max_new_tokens == 0  # accepted, clipped, not aborted
    where = "waiting" if Version(api.version) >= Version("0.5.22") else (
        "waiting (the running batch is empty but marked full, so the scheduler admits nothing)")
    with pytest.raises(ServerStuck) as stuck:
        driver.drain()
    assert str(stuck.value) == (f"1 request(s) still unfinished after 400 idle steps (req {rid} {where} with 0 of 0 "
                                "tokens out)"), stuck.value


def test_a_prompt_the_allocator_says_cannot_fit_is_answered_with_the_servers_abort(scheduling, api, monkeypatch):
    """Where the allocator answers that a prompt cannot fit the pool at all (``max_new_tokens_for_memory`` None: the
    unified pools' allocators on 0.5.23, the base one once sglang#39271 is fixed), init_req_max_new_tokens aborts it
    itself; the driver then expects the one-token prompt the abort leaves, as for a refused prompt."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS["dsa-ps64"])
    allocator = driver.server.token_to_kv_pool_allocator
    if not hasattr(allocator, "max_new_tokens_for_memory"):
        pytest.skip(f"SGLang {api.version}'s allocator has no max_new_tokens_for_memory (its Scheduler clips alone)")
    monkeypatch.setattr(allocator, "max_new_tokens_for_memory", lambda *args, **kwargs: None)
    rid = driver.add_request(length=192, share=0, max_tokens=1)
    assert driver.refused == 1 and driver.requests[rid].to_finish is not None
    assert driver.drain() is None and driver.outcome[rid] == "aborted"


def test_the_scheduler_is_told_the_capacity_its_tp_worker_reports(scheduling):
    """The Scheduler's ``max_total_num_tokens`` and ``max_req_len`` are what ``TpModelWorker.get_worker_info``
    reports from its model runner (its logical and effective capacities, which ask SGLang's configurator), not the
    allocator's free count: a hybrid SWA server reports its full pool, though its allocator counts only the smaller
    window side free, so a prompt longer than the window side is admitted, as a real server admits it."""
    c = CONFIGS["swa"]
    try:
        driver = scheduling.SglangSchedulerDriver(c)
    except ConfigError as exc:  # 0.5.9, 0.5.10: their runner sizes the window pool otherwise
        pytest.skip(str(exc))
    assert driver.family.sg_allocator.available_size() == c.swa_tokens < c.full_tokens
    assert (driver.total, driver.server.max_req_len) == (c.full_tokens, min(c.max_context, c.full_tokens) - 1)
    rid = driver.add_request(length=c.swa_tokens + 8, share=0, max_tokens=2)
    assert driver.refused == 0 and driver.drain() is None and driver.outcome[rid] == "finished"


def _small_window_server(name: str, *, window: int, swa_tokens: int, rows: int):
    """The tiny GPT-OSS server the judged sliding-window defects are shown on: one full and one sliding-window layer,
    an 11-token full pool and context, and a window pool of ``swa_tokens``."""
    from poolfuzz.pools.config import ModelConfig

    return ModelConfig(name=name, architecture="gpt-oss", full_layers=1, swa_layers=1, sliding_window=window,
                       head_num=1, head_dim=12, kv_dtype="bfloat16", full_tokens=11, swa_tokens=swa_tokens,
                       request_rows=rows, max_context=11)


def test_a_chunk_parked_on_the_swa_budget_stalls_a_small_window_pool_for_good(scheduling, api):
    """SGLang 0.5.23 (judged an engine defect, docs/bugs/sglang-swa-parked-chunk.md): a GPT-OSS server whose SWA pool
    (4 tokens) cannot hold a 4-token prompt and its output token cuts the prompt to chunks; after two, PrefillAdder's
    ``available_chunk_tokens`` keeps a page of headroom (1 - 1 = 0 tokens) and parks the last chunk, while the window
    lock holds the request's own out-of-window first node, so nothing ever frees a slot: the request waits forever
    on an idle server, with no error. With two output tokens the chunks are cut smaller and the request finishes."""
    if api.version != "0.5.23":
        pytest.skip("judged on SGLang 0.5.23")
    c = _small_window_server("swa-window-pool-4", window=2, swa_tokens=4, rows=1)
    driver = scheduling.SglangSchedulerDriver(c)
    rid = driver.add_request(length=4, share=0, max_tokens=1)
    allocator = driver.family.sg_allocator
    for _ in range(20):
        driver.step()
    assert driver.server.chunked_req is not None and driver.server.chunked_req.rid == rid
    assert allocator.swa_available_size() == 1 and not driver.server.running_batch.reqs
    assert rid not in driver.outcome
    finishing = scheduling.SglangSchedulerDriver(c.replace(name="swa-window-pool-4-two-out"))
    other = finishing.add_request(length=4, share=0, max_tokens=2)
    assert finishing.drain() is None and finishing.outcome[other] == "finished"


def test_a_prefix_hit_whose_pinned_window_leaves_the_swa_check_short_waits_for_good(scheduling, api):
    """SGLang 0.5.23 (judged an engine defect, docs/bugs/sglang-swa-parked-chunk.md): on a sliding-window server whose
    SWA pool holds about two windows, a request that hits a cached prefix locks that node while PrefillAdder checks its
    budget, so the prefix's SWA tokens are not evictable to it, and ``check_prefill`` (``needed < remaining_swa``)
    refuses it every pass as if the pressure were passing; the escape hatch serves only requests that could never fit
    the pool. On an idle server it waits forever. The same request without the prefix hit is admitted."""
    from poolfuzz.pools.errors import ServerStuck

    if api.version != "0.5.23":
        pytest.skip("judged on SGLang 0.5.23")
    c = _small_window_server("swa-window-pool-4-hit", window=2, swa_tokens=4, rows=1)
    driver = scheduling.SglangSchedulerDriver(c)
    first = driver.add_request(length=1, share=0, max_tokens=1)
    second = driver.add_request(length=1, share=1, max_tokens=1)  # the first prompt and one token more
    with pytest.raises(ServerStuck, match=r"req 000002 waiting with 0 of 1 tokens out"):
        driver.drain()
    assert driver.outcome[first] == "finished" and second not in driver.outcome
    fresh = scheduling.SglangSchedulerDriver(c.replace(name="swa-window-pool-4-no-hit"))
    fresh.add_request(length=1, share=0, max_tokens=1)
    alone = fresh.add_request(length=2, share=0, max_tokens=1)
    assert fresh.drain() is None and fresh.outcome[alone] == "finished"


def test_two_requests_the_swa_cap_cuts_in_one_pass_decode_on_a_middle_chunk(scheduling, api):
    """SGLang 0.5.23 (judged an engine defect, docs/bugs/sglang-swa-two-chunked-requests.md): on a GPT-OSS server whose
    SWA pool (5 tokens) cannot hold a 4-token prompt and its outputs, PrefillAdder cuts a 1-token chunk of the first
    request and, the chunk budget barely spent, a second one of the next request in the same pass; only the second
    becomes the scheduler's chunked request, so the first is taken out of prefill with the token sampled after its
    position 0 as its first output, and decodes on a prompt never computed. One at a time, both finish."""
    if api.version != "0.5.23":
        pytest.skip("judged on SGLang 0.5.23")
    c = _small_window_server("swa-window-pool-5", window=3, swa_tokens=5, rows=2)
    driver = scheduling.SglangSchedulerDriver(c)
    driver.add_request(length=4, share=0, max_tokens=3)
    driver.add_request(length=4, share=0, max_tokens=1)
    with pytest.raises(AssertionError, match=re.escape(
            "req 000001 step 3: SGLang holds tokens [32768, 32769, 32770, 32771, 0], but it was given "
            "[32768, 32769, 32770, 32771] (prompt, then the 0 the model sampled)")):
        driver.drain()
    apart = scheduling.SglangSchedulerDriver(c.replace(name="swa-window-pool-5-apart"))
    first = apart.add_request(length=4, share=0, max_tokens=3)
    assert apart.drain() is None
    second = apart.add_request(length=4, share=0, max_tokens=1)
    assert apart.drain() is None and apart.outcome == {first: "finished", second: "finished"}


@pytest.mark.parametrize("name", ["dense", "hybrid-linear", "swa-ps4"])
def test_an_idle_server_is_flushed_and_serves_on_its_cleared_pools(scheduling, name):
    """An operator's ``/flush_cache`` (SGLang's ``Scheduler.flush_cache``): refused while a request is queued; on the
    idle server the tree is reset and every pool and allocator cleared, so a later request sharing an earlier prefix
    matches nothing and is computed afresh, checked at every forward, and the server drains clean."""
    driver = scheduling.SglangSchedulerDriver(CONFIGS[name])
    if not driver.flushes:
        pytest.skip("this release's server is not flushed here")
    first = driver.add_request(length=10, share=0, max_tokens=3)
    assert driver.flush() is False  # a request is waiting: SGLang refuses
    assert driver.drain() is None and driver.outcome[first] == "finished"
    assert driver.family.sg_allocator.available_size() < driver.total  # the tree holds the finished request's KV
    assert driver.flush() is True and driver.state_problem() is None
    assert driver.family.sg_allocator.available_size() == driver.total  # every slot free again
    again = driver.add_request(length=4, share=4, max_tokens=3)  # the first request whole, flushed away
    assert driver.drain() is None and driver.outcome[again] == "finished"
    assert driver.first_prefix[again] == 0
    unflushed = scheduling.SglangSchedulerDriver(CONFIGS[name])  # the same traffic, no flush: the prefix is a hit
    unflushed.add_request(length=10, share=0, max_tokens=3)
    assert unflushed.drain() is None
    hit = unflushed.add_request(length=4, share=4, max_tokens=3)
    assert unflushed.drain() is None and unflushed.first_prefix[hit] > 0
