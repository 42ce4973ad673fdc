"""Campaigns: every distinct bug is reported once, by a signature that names the bug and not the
example; a known bug is counted and fuzzing goes on past it; a check can be waived."""

import json

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.harness.failures import CHECKS, SIGNATURE, WAIVABLE, bug_key, signature_from
from poolfuzz.orchestration.artifacts import load
from poolfuzz.orchestration.known import load_known
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS

THREE = ["mamba-slot-zero", "free-swa-keeps-mapping", "swa-ignores-mamba-backup"]
SIGNATURES = {"InvariantViolation:reserved:mamba", "StateLost:contents:mamba@resume",
              "InvariantViolation:ownership:swa"}


@pytest.mark.parametrize(("fault", "config", "signature"), [
    ("swa-ignores-mamba-backup", "swa-ssm", "StateLost:contents:mamba@resume"),
    ("paged-free-partial-page", "dense-ps4", "InvariantViolation:ownership:full"),
    ("mamba-leak-on-abort", "hybrid-linear", "ReferenceMismatch:free-count:mamba"),
])
def test_one_bug_one_signature_across_seeds(fault, config, signature):
    """The shrunk failure of each seed carries the same signature: no rids, slots or seeds in it."""
    got = {run_machine(CONFIGS[config], faults=[fault], max_examples=300, seed=seed, shrink_limit=10).signature
           for seed in range(3)}
    assert got == {signature}


# One bug seen with and without the allocator's double-free detection (SGLang #25805): one signature.
SAME_BUG = {"allocator-double-free-undetected": "free-swa-keeps-mapping",
            # A mamba leak is one signature whichever of a request's slots leaks (its state slot on
            # a failed resume, or its extra-buffer track slots on every release).
            "track-slots-not-freed": "mamba-leak-on-abort"}
# Faults that only show off the named configs (found with --config random, not here).
OFF_GRID = {"reload-chunk-at-chunk-number", "mamba-layer-map-contiguous", "host-load-tiles-of-four"}


def test_different_planted_bugs_get_different_signatures():
    """Every catalogue fault, on the first config it applies to: the signatures are distinct."""
    from poolfuzz.pools.faults import FAULTS, applicable_configs

    found = {}
    for fault in FAULTS:
        if fault in OFF_GRID:
            continue
        config = CONFIGS[applicable_configs(fault)[0]]
        found[fault] = run_machine(config, faults=[fault], max_examples=300, seed=0, shrink_limit=5).signature
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


def test_every_planted_bug_gets_one_artifact_and_the_run_exits_1(campaign, capsys):
    code, out = campaign
    assert code == 1
    arts = [load(p) for p in sorted(out.glob("*.json"))]
    assert {a.signature for a in arts} == SIGNATURES and len(arts) == 3
    for art in arts:
        assert art.status == "shrunk" and art.examples >= 1 and art.seconds is not None
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
    from poolfuzz.pools.faults import FAULTS, SHORTEST_KNOWN

    assert set(SHORTEST_KNOWN) == set(FAULTS)


def test_hunt_on_a_plug_in_family_runs_its_no_fault_cells():
    from minimal_family import build_minimal_family

    from poolfuzz.orchestration.hunt import hunt_cell

    row = hunt_cell("dense", None, seeds=1, budget=10, shrink_seconds=5, family_factory=build_minimal_family)
    assert row.detected == 0 and row.fault is None
