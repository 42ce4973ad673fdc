"""``poolfuzz run``: exit codes, bad usage, artifacts, the example database, output modes and workers."""

import io
import os

import pytest
from hypothesis import Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.orchestration.artifacts import load
from poolfuzz.cli import run_cli
from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.machine import machine_for
from poolfuzz.orchestration.runner import database_key, run_machine
from poolfuzz.orchestration.session import Plan, plan_lanes, run_session, worker_device
from poolfuzz.pools.config import CONFIGS

FAULT = "swa-ignores-mamba-backup"


def _no_gpu_case():
    import torch

    return pytest.param(["--device", "cuda"], "no CUDA GPU is visible",
                        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here"))


BAD_USAGE = [
    (["--config", "gpt-9"], "unknown config 'gpt-9'; choose one of"),
    (["--faults", "no-such-fault"], "unknown fault 'no-such-fault'; known faults"),
    (["--config", "dense", "--faults", FAULT], f"fault '{FAULT}' does not apply to config 'dense'"),
    (["--examples", "0"], "--examples must be at least 1"),
    (["--minutes", "-1"], "--minutes must be positive"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--db", "a-file"], "is a file, not a directory"),
    (["--db", "mongodb://x"], "unsupported scheme 'mongodb'"),
    (["--out", "a-file"], "is a file; pass a directory"),
    (["--out", "a-file/failures"], "--out 'a-file/failures' is under the file 'a-file'"),
    (["--out", "/proc/poolfuzz-failures"], "--out '/proc/poolfuzz-failures': cannot create files in '/proc'"),
    (["--db", "a-file/db"], "--db 'a-file/db' is under the file 'a-file'"),
    (["--db", "/proc/poolfuzz-db"], "--db '/proc/poolfuzz-db': cannot create files in '/proc'"),
    (["--family", "os:getcwd"], "family 'os:getcwd' (os:getcwd) cannot build config"),
    (["--config", "hybrid-linear", "--backup-mode", "host_pool"],
     "--backup-mode host_pool: config 'hybrid-linear': host_pool retraction backup cannot carry recurrent state"),
    (["--config", "random", "--backup-mode", "cpu_tensor"], "--backup-mode applies to named configs"),
    _no_gpu_case(),
]


def test_a_named_backup_mode_reaches_every_round_of_the_session(tmp_path, monkeypatch, capsys):
    """``--backup-mode`` is the plan's, and every round of the session runs its machine with it: dense resolves
    host_pool by itself, the run names cpu_tensor, and the engine reports cpu_tensor. A default config list skips
    the configs that cannot run the mode, with the builtin family's reason."""
    from poolfuzz.cli import build_parser
    from poolfuzz.cli.run import plan_from_args
    from poolfuzz.orchestration import runner

    plan = plan_from_args(build_parser().parse_args(
        ["run", "--config", "dense", "--backup-mode", "cpu_tensor", "--examples", "2", "--device", "cpu", "--db",
         "none", "--out", str(tmp_path)]))
    assert plan.backup_mode == "cpu_tensor" and plan.configs == ("dense",)
    modes = []

    def recorded(config, **kwargs):
        result = run_machine(config, **kwargs)
        modes.append((kwargs["backup_mode"], result.backup_mode))
        return result

    monkeypatch.setattr(runner, "run_machine", recorded)  # what each round of the session calls
    assert run_session(plan, stream=io.StringIO(), tty=False).exit_code == 0
    assert modes and set(modes) == {("cpu_tensor", "cpu_tensor")}
    everything = plan_from_args(build_parser().parse_args(
        ["run", "--backup-mode", "host_pool", "--examples", "1", "--device", "cpu", "--db", "none", "--out",
         str(tmp_path)]))
    assert "dense" in everything.configs and "hybrid-linear" not in everything.configs
    assert "poolfuzz: skips hybrid-linear: config 'hybrid-linear': host_pool retraction backup cannot carry" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv, problem", BAD_USAGE)
def test_bad_usage_is_one_line_exit_2_and_nothing_written(argv, problem, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    budget = [] if "--minutes" in argv else ["--examples", "1"]
    assert run_cli(["run", *budget, *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == ""
    assert "\n" not in err and err.startswith("poolfuzz: error: ") and problem in err
    assert sorted(os.listdir(tmp_path)) == ["a-file"]  # no database, no failures folder


@pytest.mark.parametrize("argv, problem", [
    (["run", "--examples", "many"], "invalid int value"),
    (["run", "--backup-mode", "tape"], "invalid choice: 'tape'"),
    (["run", "--minutes", "1", "--examples", "3"], "not allowed with argument"),
    (["replay"], "the following arguments are required: FILE"),
    (["emit-test", "x.json"], "the following arguments are required: -o/--output"),
])
def test_argument_errors_are_one_line_exit_2(argv, problem, capsys):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and problem in err and "--help" in err


def test_passing_run_exits_0_writes_no_artifact_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "failures"
    code = run_cli(["run", "--config", "dense", "swa", "--device", "cpu", "--examples", "3", "--seed", "1",
                    "--db", "none", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert not out.exists()
    assert "dense: PASS" in text and "swa: PASS" in text
    assert text.rstrip().endswith("poolfuzz: 2 passed, 0 failed")
    assert "\x1b[" not in text  # not a terminal: plain lines for CI logs


def test_faults_with_default_configs_fuzz_only_the_configs_they_apply_to(tmp_path, capsys):
    assert run_cli(["run", "--faults", FAULT, "--device", "cpu", "--examples", "1", "--seed", "2", "--db", "none",
                    "--out", str(tmp_path), "--shrink-seconds", "0.5"]) in (0, 1)
    text = capsys.readouterr().out
    assert "2 config(s)" in text and "swa-ssm-ps4" in text and "dense" not in text


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """One failing run: --examples, a seed, a short shrink, a directory database."""
    base = tmp_path_factory.mktemp("found")
    db, out = base / "db", base / "failures"
    stream = io.StringIO()
    plan = Plan(configs=("swa-ssm",), device="cpu", faults=(FAULT,), seed=9, examples=300, db=str(db),
                out=str(out), shrink_seconds=3.0)
    result = run_session(plan, stream=stream, tty=False)
    return result, stream.getvalue(), db, out


def test_failing_run_exits_1_and_writes_one_artifact(found):
    result, text, db, out = found
    assert result.exit_code == 1, text
    files = [f for f in os.listdir(out) if f.endswith(".json")]
    assert len(files) == 1 and not [f for f in os.listdir(out) if f.endswith(".tmp")]
    art = load(out / files[0])
    assert art.config == "swa-ssm" and art.faults == [FAULT] and art.seed is not None
    assert art.status in ("shrunk", "shrink-limit")
    assert art.divergence["component"].startswith("mamba.") and art.error_type == "StateLost"
    assert art.database == str(db) and art.database_key
    assert "poolfuzz replay" in text and "0 passed, 1 failed" in text
    assert run_cli(["replay", str(out / files[0]), "--device", "cpu"]) == 1


def test_artifact_keeps_hypothesis_reproduce_blob(found):
    """Besides the engine program, the artifact carries @reproduce_failure for the same example."""
    import re

    from hypothesis import reproduce_failure

    _, _, _, out = found
    art = load(next(out.glob("*.json")))
    version, blob = re.fullmatch(r"@reproduce_failure\('(.*)', b'(.*)'\)", art.reproduce_blob).groups()
    machine = reproduce_failure(version, blob.encode())(machine_for("swa-ssm", faults=[FAULT]))
    with pytest.raises(StateLost):
        run_state_machine_as_test(machine, settings=settings(database=None, deadline=None, print_blob=False))


def test_failure_is_in_the_database_for_a_plain_hypothesis_run(found):
    """A plain run_state_machine_as_test of the same machine, replay phase only, fails at once."""
    _, _, db, _ = found
    machine = machine_for("swa-ssm", faults=[FAULT], backup_mode="cpu_tensor")
    with pytest.raises(StateLost):
        run_state_machine_as_test(machine, settings=settings(
            database=DirectoryBasedExampleDatabase(str(db)), phases=[Phase.reuse], max_examples=5, deadline=None))


def test_failure_is_replayed_first_by_a_later_run(found):
    _, _, db, _ = found
    result = run_machine(CONFIGS["swa-ssm"], faults=[FAULT], max_examples=50, seed=12345,
                         database=DirectoryBasedExampleDatabase(str(db)), shrink_limit=0.5)
    assert not result.passed and result.first_failure_examples == 1


def test_each_machine_has_its_own_database_key(found):
    """Config, faults and backup mode pick the key: the fault's failure is not replayed on the correct family."""
    _, _, db, _ = found
    database = DirectoryBasedExampleDatabase(str(db))
    faulty = database_key(machine_for("swa-ssm", faults=[FAULT]))
    assert faulty == database_key(machine_for("swa-ssm", faults=[FAULT], backup_mode="cpu_tensor"))
    assert list(database.fetch(faulty))
    for other in (machine_for("swa-ssm"), machine_for("swa-ssm-ps4", faults=[FAULT]), machine_for("dense")):
        assert database_key(other) != faulty
        assert not list(database.fetch(database_key(other)))


def test_terminal_output_is_a_live_block(tmp_path):
    stream = io.StringIO()
    plan = Plan(configs=("dense",), device="cpu", seed=1, examples=4, db=None, out=str(tmp_path))
    assert run_session(plan, stream=stream, tty=True).exit_code == 0
    text = stream.getvalue()
    assert "\x1b[" in text and "elapsed" in text and "failures so far" in text and "steps/s" in text
    assert "poolfuzz: 1 passed, 0 failed" in text


def test_time_budget_is_kept(tmp_path, monkeypatch):
    """--minutes is the wall clock of the whole run: split between the lanes, checked before every
    example. The clock is a fake that every reading moves on by 10 ms, so what is measured is the
    bookkeeping, not the speed of the machine the test runs on."""
    import types

    from poolfuzz.orchestration import runner, session

    readings = [0.0]

    def read():
        readings[0] += 0.01
        return readings[0]

    fake = types.SimpleNamespace(time=read, monotonic=read, perf_counter=read)
    monkeypatch.setattr(session, "time", fake)
    monkeypatch.setattr(runner, "time", fake)
    stream = io.StringIO()
    plan = Plan(configs=("dense", "swa"), device="cpu", seed=1, seconds=2.0, db=None, out=str(tmp_path))
    result = run_session(plan, stream=stream, tty=False)
    assert result.exit_code == 0
    assert all(s.status == "PASS" and s.examples >= 2 for s in result.lanes)
    # Each lane stops at the first example that starts past its share (the first lane gets half).
    first, second = result.lanes
    assert 1.0 <= first.seconds < 1.0 + 0.5 and first.seconds + second.seconds < 2.0 + 0.5


def test_lanes_split_configs_and_seeds():
    plan = Plan(configs=("a", "b", "c"), device="cpu", seed=5, examples=10, workers=2)
    lanes = plan_lanes(plan)
    assert [[l.config for l in w] for w in lanes] == [["a", "c"], ["b"]]
    # a lane's seed is --seed and its own name, whatever runs before it: `--config c --seed 5` alone draws the same
    assert len({l.seed for w in lanes for l in w}) == 3
    alone = plan_lanes(Plan(configs=("c",), device="cpu", seed=5, examples=10, workers=1))
    assert alone[0][0].seed == next(l.seed for w in lanes for l in w if l.config == "c")
    many = plan_lanes(Plan(configs=("a",), device="cpu", seed=5, examples=10, workers=3))
    assert [w[0].config for w in many] == ["a", "a", "a"]
    assert len({w[0].seed for w in many}) == 3 and sorted(w[0].examples for w in many) == [3, 3, 4]


def test_a_lane_draws_the_same_examples_alone_as_after_other_lanes(tmp_path, capsys):
    """A user re-running one config of a larger run, with its seed, gets the examples that config's lane tried there
    (it was seeded by its place in the run: the same config drew other programs after another)."""
    def steps(*configs: str) -> str:
        assert run_cli(["run", "--config", *configs, "--device", "cpu", "--examples", "4", "--seed", "1", "--db",
                        "none", "--out", str(tmp_path / "out")]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dense "))
        return row.split()[4]  # config, status, examples, declined, steps

    assert steps("dense") == steps("swa", "dense") == steps("swa-ps4", "mla", "dense")


def test_worker_i_uses_gpu_i_on_a_multi_gpu_machine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [worker_device("cuda", i, 4) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert worker_device("cuda", 5, 6) == "cuda:1"
    assert worker_device("cuda:2", 1, 4) == "cuda:2"  # an explicit GPU is kept
    assert worker_device("cuda", 0, 1) == "cuda"
    assert worker_device("cpu", 1, 4) == "cpu"


@pytest.mark.slow
def test_two_workers_share_the_database(tmp_path, capsys):
    """Two spawned processes split the configs; the faulty config's failure lands in the shared database."""
    db, out = tmp_path / "db", tmp_path / "failures"
    code = run_cli(["run", "--workers", "2", "--config", "swa-ssm", "swa-ssm-ps4", "--faults", FAULT,
                    "--device", "cpu", "--examples", "300", "--seed", "6", "--db", str(db), "--out", str(out),
                    "--shrink-seconds", "0.5"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert "2 worker(s)" in text and "0 passed, 2 failed" in text
    assert len([f for f in os.listdir(out) if f.endswith(".json")]) == 2
    for config in ("swa-ssm", "swa-ssm-ps4"):
        result = run_machine(CONFIGS[config], faults=[FAULT], max_examples=20, seed=99,
                             database=DirectoryBasedExampleDatabase(str(db)), shrink_limit=0.2)
        assert result.first_failure_examples == 1


@pytest.mark.parametrize("header", ["Falsifying example:", "Failing test case: <state machine>"])
def test_the_reported_program_is_python_whatever_hypothesis_calls_it(header):
    """Hypothesis renamed its report header (6.16x); the program kept is only the runnable lines."""
    from poolfuzz.harness.hypothesis_compat import runnable_program as _runnable_program

    notes = [f"{header}\nstate = PoolMachine()\nstate.warm_start(prompts=[1])\nstate.teardown()",
             "\nYou can reproduce this example by temporarily adding @reproduce_failure(...)",
             "Highest target score: 1  (label='peak pool pressure')"]
    program = _runnable_program(notes)
    assert program == "state = PoolMachine()\nstate.warm_start(prompts=[1])\nstate.teardown()"
    compile(program, "<program>", "exec")
    assert _runnable_program(["Flaky: nothing runnable here"]) is None


def test_a_step_that_raises_is_kept_in_the_program_with_named_arguments():
    """The seqlen-1 check fails inside retract, before the step records itself: the runner adds it."""
    result = run_machine(CONFIGS["dense"], faults=["backup-drops-last-token"], max_examples=50, shrink_limit=2)
    last = result.engine_steps[-1]
    assert (last.op, list(last.args), last.outcome) == ("retract", ["rid"], "raised ReferenceMismatch")
    admitted = [step.outcome for step in result.engine_steps if step.op == "admit"]
    assert any(outcome.startswith(f"Req({last.args['rid']}) ") for outcome in admitted)


@pytest.mark.slow
def test_an_artifact_that_cannot_be_written_is_printed_and_the_run_exits_1(tmp_path, monkeypatch, capsys):
    """The disk fills up after the checks: the failure and its artifact go to the terminal instead,
    whole, so it can still be saved and replayed."""
    import json

    from poolfuzz.orchestration import artifacts

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifacts, "write_atomic", no_space)
    monkeypatch.setattr(artifacts, "write_new_atomic", no_space)
    out = tmp_path / "failures"
    code = run_cli(["run", "--config", "swa-ssm", "--faults", FAULT, "--device", "cpu", "--examples", "300",
                    "--seed", "9", "--db", "none", "--out", str(out), "--shrink-seconds", "1"])
    captured = capsys.readouterr()
    text = captured.out
    assert code == 1, text + captured.err
    assert "FAIL StateLost" in text and "Traceback" not in text + captured.err
    assert f"could not write the artifact under {out}/ (No space left on device)" in text
    start = text.index("--- artifact ---\n") + len("--- artifact ---\n")
    raw = json.loads(text[start:text.index("--- end of artifact ---")])
    monkeypatch.undo()
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(raw))
    assert run_cli(["replay", str(saved), "--device", "cpu"]) == 1
    assert not out.exists() or not list(out.iterdir())  # nothing half-written left behind


def test_a_run_never_runs_more_examples_than_asked():
    """Hypothesis counts only valid examples against max_examples; the run counts every one."""
    for seed in range(3):
        result = run_machine(CONFIGS["swa-ssm"], max_examples=40, seed=seed)
        assert result.passed and result.examples == 40 and result.shrink_examples == 0


def test_shrinking_is_counted_apart_from_the_examples_to_the_first_failure():
    result = run_machine(CONFIGS["swa-ssm"], faults=[FAULT], max_examples=200, seed=0)
    assert not result.passed
    assert result.examples == result.first_failure_examples and result.shrink_examples > 0


def test_a_finished_run_leaves_no_machine_class_behind():
    """Hypothesis keeps every state-machine class it ran in a class-level dict; a long session
    would keep every finished run's machine, tracker and callbacks alive."""
    from hypothesis.stateful import RuleBasedStateMachine

    before = set(RuleBasedStateMachine._setup_state_per_class)
    run_machine(CONFIGS["dense"], max_examples=3, seed=1)
    run_machine(CONFIGS["swa-ssm"], faults=[FAULT], max_examples=100, seed=0, shrink_limit=1)
    assert set(RuleBasedStateMachine._setup_state_per_class) == before


def test_a_finished_config_releases_its_cached_rows(tmp_path):
    """Each config's components key their own cached rows; a long run over every config must not
    hold all of them at once (memory grew by tens of MB per config before)."""
    from poolfuzz.harness import row_cache

    plan = Plan(configs=("dense", "swa-ssm"), device="cpu", seed=1, examples=3, db=None, out=str(tmp_path))
    run_session(plan, stream=io.StringIO(), tty=False)
    assert row_cache._cache == {} and row_cache._ledger is None


def test_the_heartbeat_counts_distinct_failures_of_a_lane_that_keeps_going():
    """A lane that found two bugs and is shrinking a third reads "3 failures so far", not one per lane."""
    from poolfuzz.orchestration.display import Display, Finding, LaneState

    from types import SimpleNamespace

    lane = LaneState(lane=SimpleNamespace(index=0), label="swa-ssm", status="shrinking")
    lane.findings += [Finding(signature=f"S{i}", failure="x", artifact=None, program_steps=1, examples_to_find=1,
                              seconds_to_find=0.0, how="shrunk") for i in range(2)]
    plan = Plan(configs=("swa-ssm",), device="cpu", seed=1, examples=4, db=None, out="unused")
    display = Display(plan, [lane], io.StringIO(), tty=False)
    assert display._totals(display.started).endswith("3 failures so far")
    lane.status = "running"
    assert display._totals(display.started).endswith("2 failures so far")
