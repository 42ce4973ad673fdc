"""Campaigns: every distinct bug is reported once, by a signature that names the bug and not the
example; a known bug is counted and fuzzing goes on past it; a check can be waived."""

import json

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.errors import UsageError
from poolfuzz.harness.failures import CHECKS, SIGNATURE, WAIVABLE, bug_key, signature_from
from poolfuzz.orchestration.artifacts import load
from poolfuzz.orchestration.known import known_on, load_known
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS
from tests.quality.test_fault_catalogue import SEED as CATALOGUE_SEED

THREE = ["mamba-slot-zero", "free-swa-keeps-mapping", "swa-ignores-mamba-backup"]
SIGNATURES = {"InvariantViolation:reserved:mamba", "StateLost:contents:mamba@resume",
              "InvariantViolation:ownership:swa"}


@pytest.mark.parametrize(("fault", "config", "signature"), [
    ("swa-ignores-mamba-backup", "swa-ssm", "StateLost:contents:mamba@resume"),
    ("paged-free-partial-page", "dense-ps4", "InvariantViolation:ownership:full"),
    ("mamba-leak-on-abort", "hybrid-linear", "ReferenceMismatch:free-count:mamba"),
])
@pytest.mark.slow
def test_one_bug_one_signature_across_seeds(fault, config, signature):
    """The shrunk failure of each seed carries the same signature: no rids, slots or seeds in it."""
    got = {run_machine(CONFIGS[config], faults=[fault], max_examples=300, seed=seed, shrink_limit=10).signature
           for seed in range(3)}
    assert got == {signature}


# One bug seen with and without the allocator's double-free detection (SGLang #25805): one signature.
# SGLang #29354 seen two ways, the copy-on-write dropped or reading the source's live slot instead of
# the tree's checkpoint: either way the forked request's first forward loses its state (one signature;
# the report's text says whose data the slot holds).
SAME_BUG = {"allocator-double-free-undetected": "free-swa-keeps-mapping", "stale-cow-source": "cow-without-copy",
            # A mamba leak is one signature whichever of a request's slots leaks (its state slot on
            # a failed resume, or its extra-buffer track slots on every release).
            "track-slots-not-freed": "mamba-leak-on-abort",
            # A verify commit that leaves a wrong state in the slot, whether it kept the rejected drafts or
            # read another scratch row: the report's text says whose state the slot holds.
            "spec-commit-batch-position": "spec-commit-last-draft",
            # A resume that leaves SWA rows unloaded, whether the SWA pool's reload ignored its masks or
            # the host pool's load skipped a layer: the report's text names the layer and position.
            "host-load-stops-at-pool-layer-count": "swa-reload-unmapped-rows",
            # A PD item that is not a latent row (the MLA value width, or the hybrid pool's MHA head width), and a
            # retraction copy without the block scales (MXFP8's or FP4 MHA's): the same bug in another pool class.
            "hybrid-mla-pd-item-of-head-width": "mla-pd-item-of-latent-width",
            "fp4-mha-copy-drops-scales": "scaled-copy-drops-scales"}
# Faults that only show off the named configs (found with --config random, not here).
OFF_GRID = {"reload-chunk-at-chunk-number", "mamba-layer-map-contiguous", "host-load-tiles-of-four"}


@pytest.mark.slow
def test_different_planted_bugs_get_different_signatures():
    """Every catalogue fault, on the first config it applies to: the signatures are distinct."""
    from poolfuzz.pools.faults import FAULTS, applicable_configs

    found = {}
    for fault in FAULTS:
        if fault in OFF_GRID:
            continue
        config = CONFIGS[applicable_configs(fault)[0]]
        # the catalogue's seed for the cell: the one whose first failure is the fault's own (see its SEED)
        seed = CATALOGUE_SEED.get(f"{fault}@{config.name}", 0)
        found[fault] = run_machine(config, faults=[fault], max_examples=300, seed=seed, shrink_limit=5).signature
    assert all(SIGNATURE.match(s) for s in found.values()), found
    for fault, same in SAME_BUG.items():
        assert found.pop(fault) == found[same]
    assert len(set(found.values())) == len(found), found


def test_a_persistent_state_check_names_one_bug_whatever_operation_saw_it():
    assert bug_key("InvariantViolation:ownership:swa@decode") == bug_key("InvariantViolation:ownership:swa@retract")
    assert bug_key("InvariantViolation:ownership:swa@decode") == "InvariantViolation:ownership:swa"
    assert bug_key("StateLost:contents:mamba@resume") != bug_key("StateLost:contents:mamba@prefill")


def test_a_recorded_failure_has_the_signature_of_the_live_one():
    result = run_machine(CONFIGS["swa-ssm"], faults=["swa-ignores-mamba-backup"], max_examples=100, seed=0)
    assert signature_from(result.error_type, result.divergence, in_teardown=result.in_teardown) == result.signature


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """Three planted bugs, one run that keeps going past each. The shrink budget is wall-clock time:
    generous, so that a loaded 2-core machine (or an example stream that other modules' literals
    shift) still sees every shrink finish; what is asserted is the campaign, not the shrink speed."""
    out = tmp_path_factory.mktemp("campaign") / "failures"
    code = run_cli(["run", "--config", "swa-ssm", "--faults", *THREE, "--examples", "200", "--seed", "1",
                    "--db", "none", "--out", str(out), "--shrink-seconds", "30"])
    return code, out


@pytest.mark.slow
def test_every_planted_bug_gets_one_artifact_and_the_run_exits_1(campaign, capsys):
    code, out = campaign
    assert code == 1
    arts = [load(p) for p in sorted(out.glob("*.json"))]
    assert {a.signature for a in arts} == SIGNATURES and len(arts) == 3
    for art in arts:
        # --shrink-seconds is wall time: on a loaded machine a shrink may be cut, never lost
        assert art.status in ("shrunk", "shrink-limit") and art.examples >= 1 and art.seconds is not None
        assert art.engine_options["known"] == [] or set(art.engine_options["known"]) < SIGNATURES


def test_a_rerun_with_the_known_bugs_finds_nothing_new_and_exits_0(campaign, tmp_path, capsys):
    _, out = campaign
    code = run_cli(["run", "--config", "swa-ssm", "--faults", *THREE, "--examples", "100", "--seed", "2",
                    "--db", "none", "--out", str(tmp_path / "again"), "--known", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "again").exists()
    assert "known failures passed over" in text and "poolfuzz: 1 passed, 0 failed" in text


def test_known_signatures_from_a_text_file(tmp_path):
    f = tmp_path / "known.txt"
    f.write_text("# bugs we live with\nStateLost:contents:mamba@resume\n\nInvariantViolation:reserved:mamba@init  # slot 0\n")
    assert load_known(str(f)) == ("StateLost:contents:mamba@resume", "InvariantViolation:reserved:mamba@init")


def test_a_signature_known_on_one_config_is_a_finding_on_every_other(tmp_path, capsys):
    f = tmp_path / "known.txt"
    f.write_text("# judged on dense only\ndense  ReferenceMismatch:free-count:full\nCrash:KeyError@admit\n")
    known = load_known(str(f))
    assert known == ("dense ReferenceMismatch:free-count:full", "Crash:KeyError@admit")
    assert known_on(known, "dense") == ("ReferenceMismatch:free-count:full", "Crash:KeyError@admit")
    assert known_on(known, "dense-ps4") == ("Crash:KeyError@admit",)
    # judged through one engine path: a finding on every other path over the same config
    f.write_text("sglang:hicache hybrid-linear StateLost:contents:mamba@teardown\n")
    known = load_known(str(f))
    assert known_on(known, "hybrid-linear", "sglang:hicache") == ("StateLost:contents:mamba@teardown",)
    assert known_on(known, "hybrid-linear", "sglang") == () and known_on(known, "hybrid-linear") == ()
    assert known_on(known, "swa-ssm", "sglang:hicache") == ()
    # the built-in family by name matches a run without --family (slot 0 in the mamba free list, as below)
    f.write_text("builtin hybrid-linear InvariantViolation:reserved:mamba\n")
    assert run_cli(["run", "--faults", "mamba-slot-zero", "--config", "hybrid-linear", "--examples", "5", "--seed",
                    "1", "--db", "none", "--out", str(tmp_path / "b"), "--known", str(f)]) == 0
    f.write_text("a b c StateLost:contents:mamba@teardown\n")
    with pytest.raises(UsageError, match="line 1 is not a failure signature"):
        load_known(str(f))
    # slot 0 in the mamba free list fails every example at step 0: known on hybrid-linear, new on -ps4
    f.write_text("hybrid-linear InvariantViolation:reserved:mamba\n")
    common = ["run", "--faults", "mamba-slot-zero", "--examples", "10", "--seed", "1", "--db", "none", "--known", str(f)]
    assert run_cli([*common, "--config", "hybrid-linear", "--out", str(tmp_path / "known")]) == 0
    assert "InvariantViolation:reserved:mamba" in capsys.readouterr().out
    assert run_cli([*common, "--config", "hybrid-linear-ps4", "--out", str(tmp_path / "new")]) == 1
    assert "InvariantViolation: mamba free list holds the reserved slot" in capsys.readouterr().out


def test_the_shipped_known_defects_name_configs_that_exist():
    """ci/known/*.txt: every line judged on one named config (a bare signature would hide it everywhere), and where
    it names a family, one that is shipped."""
    from pathlib import Path

    from poolfuzz.orchestration.plugins import SHIPPED
    from poolfuzz.pools import CONFIGS

    files = sorted((Path(__file__).parents[2] / "ci" / "known").glob("*.txt"))
    assert files
    for f in files:
        for entry in load_known(str(f)):
            *where, signature = entry.split(" ")
            assert where and where[-1] in CONFIGS, (f.name, entry)
            assert len(where) == 1 or where[0] in SHIPPED, (f.name, entry)


@pytest.mark.parametrize(("argv", "problem"), [
    (["--known", "nowhere"], "does not exist"),
    (["--known", "@BAD"], None),
    (["--waive", "outcome"], "cannot be waived"),
    (["--waive", "no-such-check"], "is not a check"),
])
def test_bad_known_or_waive_is_one_line_exit_2(argv, problem, tmp_path, capsys):
    if argv[1] == "@BAD":
        bad = tmp_path / "bad.txt"
        bad.write_text("this is not a signature\n")
        argv, problem = ["--known", str(bad)], "line 1 is not a failure signature"
    code = run_cli(["run", "--config", "dense", "--examples", "1", "--db", "none", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and problem in err and "Traceback" not in err


def test_a_waived_check_counts_instead_of_failing(tmp_path, capsys):
    """mamba-slot-zero fires at step 0 of every example; waived, the run reports its count."""
    from poolfuzz.harness.records import EngineOptions

    plain = run_machine(CONFIGS["hybrid-linear"], faults=["mamba-slot-zero"], max_examples=5, seed=0, shrink_limit=0)
    assert plain.signature == "InvariantViolation:reserved:mamba"
    waived = run_machine(CONFIGS["hybrid-linear"], faults=["mamba-slot-zero"], max_examples=5, seed=0, shrink_limit=0,
                         options=EngineOptions(waive=("reserved", "free-count", "free-list")))
    assert waived.waived["reserved"] >= 1 and "reserved" not in (waived.signature or "")


def test_every_check_named_in_a_signature_is_listed():
    assert {"contents", "ownership", "reserved", "free-count", "outcome"} <= set(CHECKS) and WAIVABLE < set(CHECKS)


def test_an_old_artifact_gets_its_signature_from_its_record(tmp_path):
    art = run_machine(CONFIGS["swa-ssm"], faults=["swa-ignores-mamba-backup"], max_examples=100, seed=0)
    from poolfuzz.orchestration.artifacts import from_program

    recorded = from_program("swa-ssm", [{"op": s.op, "args": s.args} for s in art.engine_steps],
                            faults=["swa-ignores-mamba-backup"])
    raw = json.loads(__import__("poolfuzz.orchestration.artifacts", fromlist=["x"]).dumps(recorded))
    del raw["signature"]
    for key in ("check", "action", "space"):
        raw["divergence"].pop(key, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert load(path).signature == "StateLost:state-lost:mamba@resume"


def test_hunt_names_each_cell_by_signature_and_measures_the_shrink():
    from poolfuzz.orchestration.hunt import format_row, hunt_cell

    row = hunt_cell("swa-ssm", "swa-ignores-mamba-backup", seeds=2, budget=200, shrink_seconds=10)
    assert row.detected == 2 and row.signature == "StateLost:contents:mamba@resume" and row.signatures == 1
    assert row.shortest_known == 4 and row.worst_shrunk is not None and row.shrink_within_two is not None
    assert "StateLost:contents:mamba@resume" in format_row(row)


def test_every_fault_has_a_shortest_known_program():
    from poolfuzz.pools.config import get_config
    from poolfuzz.pools.faults import FAULTS, applicable_configs
    from poolfuzz.pools.shortest_known import SHORTEST_KNOWN, SHORTEST_KNOWN_ON_SHAPE

    assert set(SHORTEST_KNOWN) == set(FAULTS)
    for fault, (has_shape, length, _why) in SHORTEST_KNOWN_ON_SHAPE.items():
        assert length > SHORTEST_KNOWN[fault]  # a shape's own length only where it is longer
        shaped = [c for c in applicable_configs(fault) if has_shape(get_config(c))]
        assert shaped and len(shaped) < len(applicable_configs(fault))  # a shape, not every config


def test_hunt_on_a_plug_in_family_runs_its_no_fault_cells():
    from minimal_family import build_minimal_family

    from poolfuzz.orchestration.hunt import hunt_cell

    row = hunt_cell("dense", None, seeds=1, budget=10, shrink_seconds=5, family_factory=build_minimal_family)
    assert row.detected == 0 and row.fault is None


def _story_then_fork(options):
    from poolfuzz.harness.program import new_engine, replay
    from poolfuzz.harness.records import StepRecord
    from tests.cover.programs import FAULT_35957, PROGRAM_35957

    steps = [StepRecord(op=s["op"], args=s["args"], outcome="") for s in PROGRAM_35957] + [
        StepRecord(op="fork", args={"src_rid": 1, "extra": 1}, outcome=""),
        StepRecord(op="prefill", args={"rid": 2, "chunk": 1}, outcome="")]
    engine = new_engine(config=CONFIGS["swa-ssm"], faults=[FAULT_35957], options=options)
    return engine, [ev.failure for ev in replay(engine, steps)]


def test_a_request_forked_from_one_a_known_bug_touched_is_downstream_of_it():
    """#35957 known: the resumed request's lost state is passed over, and so is the fork that copies it."""
    engine, failures_seen = _story_then_fork({"known": ("StateLost:contents:mamba@resume",)})
    assert failures_seen == [None] * 7
    assert engine.tainted_requests == {1, 2}  # the fork (Req 2) inherits the suspicion
    assert engine.passed_over["StateLost:contents:mamba@resume"] >= 1
    assert engine.passed_over["StateLost:contents:mamba@prefill.forked"] >= 1
    _, unknown = _story_then_fork({})
    assert type(unknown[3]).__name__ == "StateLost"  # without --known the story fails at the resume


def test_the_contents_check_can_be_waived():
    engine, failures_seen = _story_then_fork({"waive": ("contents",)})
    assert failures_seen == [None] * 7 and engine.waived["contents"] >= 2


def test_a_pool_error_in_the_space_of_a_known_bug_is_downstream_of_it():
    """The kept SWA mapping is known (ownership:swa); the double free it causes later, at another
    slot, is its consequence, not a second bug: the campaign passes over it."""
    from poolfuzz.harness.program import new_engine, replay
    from poolfuzz.harness.records import StepRecord
    from tests.cover.programs import FAULT_KEPT_MAPPING, PROGRAM_KEPT_MAPPING_DOUBLE_FREE

    steps = [StepRecord(op=s["op"], args=s["args"], outcome="") for s in PROGRAM_KEPT_MAPPING_DOUBLE_FREE]
    engine = new_engine(config=CONFIGS["swa-ssm"], faults=[FAULT_KEPT_MAPPING],
                        options={"known": ("InvariantViolation:ownership:swa",)})
    failure = list(replay(engine, steps))[-1].failure
    assert failure.divergence.check == "pool-error" and "DoubleFree" in str(failure)
    assert engine.tainted(failure.divergence)
    fresh = new_engine(config=CONFIGS["swa-ssm"], faults=[FAULT_KEPT_MAPPING])
    first = next(ev.failure for ev in replay(fresh, steps) if ev.failure is not None)
    assert first.divergence.check == "ownership"  # unknown, the same program shows the root cause first


def test_a_fork_of_the_request_holding_a_known_bugs_slot_is_downstream():
    """The slot-zero bug known: the holder of slot 0 is named, so its fork's clobbered state is too."""
    from poolfuzz.harness.program import new_engine, replay
    from poolfuzz.harness.records import StepRecord
    from tests.cover.programs import PROGRAM_SLOT_ZERO_FORK

    steps = [StepRecord(op=s["op"], args=s["args"], outcome="") for s in PROGRAM_SLOT_ZERO_FORK]
    faults = ["mamba-slot-zero"]
    engine = new_engine(config=CONFIGS["swa-ssm"], faults=faults,
                        options={"known": ("InvariantViolation:reserved:mamba",)})
    assert [ev.failure for ev in replay(engine, steps)][:len(steps)] == [None] * len(steps)
    assert engine.passed_over.get("StateLost:contents:mamba@prefill.forked", 0) >= 1
    assert {1, 3} <= engine.tainted_requests
    fresh = new_engine(config=CONFIGS["swa-ssm"], faults=faults, options={"waive": ("reserved", "free-count", "free-list")})
    failure = next(ev.failure for ev in replay(fresh, steps) if ev.failure is not None)
    assert failure.divergence.rid == 3 and failure.divergence.check == "contents"  # unknown: it is reported


def test_a_crash_signature_is_a_signature_a_known_file_and_an_artifact_accept(tmp_path):
    """A crash is named by its exception and the action that raised it, and can be listed as known."""
    from poolfuzz.harness.failures import divergence_of, signature_of

    class Engine:
        step, op, action = 3, "decode", "retract"  # a decode that retracted under pressure

    crash = NotImplementedError()
    assert signature_of(crash, op=Engine.action) == "Crash:NotImplementedError@retract"
    assert signature_from("NotImplementedError", divergence_of(crash, Engine)) == "Crash:NotImplementedError@retract"
    assert SIGNATURE.match("Crash:NotImplementedError@retract") and not SIGNATURE.match("Crash:Not Impl@x")
    f = tmp_path / "known.txt"
    f.write_text("Crash:IndexError@admit\n")
    assert "Crash:IndexError@admit" in load_known(str(f))


def test_a_crash_without_a_message_says_where_it_was_raised():
    """SGLang raises some of its refusals bare (``raise NotImplementedError()`` in a tree's ``evictable_size``): the
    report names the two innermost frames instead of an empty text; a crash with a text keeps its text alone."""
    from poolfuzz.harness.failures import message_of

    def evictable_size():
        raise NotImplementedError()

    def token_info():
        return evictable_size()

    try:
        token_info()
    except NotImplementedError as exc:
        bare = exc
    caller, raiser = bare.__traceback__.tb_next, bare.__traceback__.tb_next.tb_next
    assert message_of(bare) == (f"NotImplementedError: raised without a message in {__file__}:{raiser.tb_lineno} "
                                f"evictable_size, called from {__file__}:{caller.tb_lineno} token_info")
    assert message_of(NotImplementedError()) == "NotImplementedError: raised without a message"
    assert message_of(IndexError("index 9 is out of bounds")) == "IndexError: index 9 is out of bounds"


def test_a_crash_is_downstream_only_of_a_known_bug_that_reached_its_request():
    from poolfuzz.harness.program import new_engine

    engine = new_engine(config=CONFIGS["swa-ssm"], options={"known": ("InvariantViolation:free-list:rows",)})
    engine.taint.add(("rows", None))  # a known bug in another space, reaching no request
    engine.pending = ("admit", {"prompt_len": 1})
    assert not engine.crash_downstream()  # an index out of bounds on a fresh admit is its own bug
    engine.tainted_requests.add(2)
    engine.pending = ("finish", {"rid": 2})
    assert engine.crash_downstream()
    engine.pending = ("decode", {"rids": [1, 2]})
    assert engine.crash_downstream()


def test_a_pool_error_in_a_space_a_known_bug_broke_is_downstream_of_it():
    """free_swa keeps full_to_swa (known as ownership:swa, with no request named when the kept slot is
    handed out again in the same step): the release that frees the kept slot a second time raises
    DoubleFree in the swa pool, for a request the known bug never named. The space says it is the same bug."""
    from poolfuzz.harness.program import new_engine
    from poolfuzz.pools.errors import DoubleFree, InvalidSlot

    engine = new_engine(config=CONFIGS["swa-ssm"], options={"known": ("InvariantViolation:ownership:swa",)})
    engine.taint.add(("swa", 13))
    engine.pending = ("abort", {"rid": 1})
    assert engine.crash_downstream(DoubleFree(space="swa", slot=3))
    assert not engine.crash_downstream(DoubleFree(space="full", slot=3))  # another space: a bug of its own
    assert not engine.crash_downstream(InvalidSlot(space="mamba", slot=0, reason="reserved"))
    assert not engine.crash_downstream(IndexError("index 9 is out of bounds"))  # names no space


def test_an_outcome_that_runs_out_of_a_known_leaks_space_is_downstream_of_it():
    """The leak of mamba slots known (free-count:mamba): a later resume that runs out of mamba slots
    where the reference expects KV to run out involves the leaked space, so it is the leak again."""
    from poolfuzz.harness.program import new_engine, replay
    from poolfuzz.harness.records import StepRecord
    from tests.cover.programs import FAULT_LEAK_ON_ABORT, PROGRAM_LEAK_THEN_OUTCOME

    steps = [StepRecord(op=s["op"], args=s["args"], outcome="") for s in PROGRAM_LEAK_THEN_OUTCOME]
    engine = new_engine(config=CONFIGS["hybrid-linear"], faults=[FAULT_LEAK_ON_ABORT],
                        options={"known": ("ReferenceMismatch:free-count:mamba",)})
    failure = list(replay(engine, steps))[-1].failure
    d = failure.divergence
    assert (d.check, d.space, d.expected, d.found) == ("outcome", "full", "full exhausted", "mamba exhausted")
    assert d.spaces() == ("full", "mamba") and engine.tainted(d)
    fresh = new_engine(config=CONFIGS["hybrid-linear"], faults=[FAULT_LEAK_ON_ABORT])
    first = next(ev for ev in replay(fresh, steps) if ev.failure is not None)
    assert first.index == 7 and first.failure.divergence.check == "free-count"  # unknown: the root cause
