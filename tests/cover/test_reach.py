"""``poolfuzz run --coverage DIR``: the reach of a run over the engine's code, measured in every worker."""

import inspect
import json
import os
import sys
from pathlib import Path

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.pools import errors, faults

pytest.importorskip("coverage", reason="coverage.py is a dependency of poolfuzz (pip install -e .)")

ENGINE = "poolfuzz/pools"


def _measured_run(tmp_path, *argv):
    reach = tmp_path / "reach"
    code = run_cli(["run", "--examples", "6", "--seed", "3", "--db", "none", "--out", str(tmp_path / "out"),
                    "--coverage", str(reach), *argv])
    return code, reach


def _line_of(obj) -> int:
    return inspect.getsourcelines(obj)[1]


def _body_lines(func) -> set[int]:
    lines, first = inspect.getsourcelines(func)
    return {first + i for i, text in enumerate(lines) if i and text.strip() and not text.strip().startswith(('"', "#"))}


@pytest.mark.slow
def test_two_workers_are_measured_and_combined_into_a_per_file_table(tmp_path, capsys):
    code, reach = _measured_run(tmp_path, "--config", "dense", "swa", "--workers", "2")
    assert code == 0
    out = capsys.readouterr().out
    table = json.loads((reach / "reach.json").read_text())
    files = table["files"]
    assert set(files) >= {f"{ENGINE}/allocator.py", f"{ENGINE}/swa_allocator.py", f"{ENGINE}/kv.py"}
    assert all(name.startswith(f"{ENGINE}/") for name in files)  # only the engine code, relative to its root
    # dense ran in worker 0, swa in worker 1: the SWA allocator's reach comes from the second worker alone.
    for name in (f"{ENGINE}/allocator.py", f"{ENGINE}/swa_allocator.py", f"{ENGINE}/protocol.py"):
        figures = files[name]
        assert 0 < figures["executed"] < figures["statements"], (name, figures)
        assert 0 < figures["taken"] <= figures["branches"], (name, figures)
    # The table's figures are coverage.py's own, file by file, and add up to the total.
    raw = json.loads((reach / "coverage.json").read_text())["files"]
    by_name = {os.path.relpath(k, table["root"]): v["summary"] for k, v in raw.items()}
    assert {k: (v["num_statements"], v["covered_lines"]) for k, v in by_name.items()} == \
        {k: (v["statements"], v["executed"]) for k, v in files.items()}
    assert table["total"]["executed"] == sum(v["executed"] for v in files.values())
    assert (reach / "html" / "index.html").is_file()
    assert not list(reach.glob(".coverage.*"))  # the workers' data files are combined into one
    for name, figures in files.items():
        assert f"{name} " in out
    assert "total" in out and "reach written to" in out
    # The table comes before the closing count, which stays the last line, as a test runner prints it.
    assert out.index("reach written to") < out.index("poolfuzz: 2 passed, 0 failed")
    assert out.rstrip().splitlines()[-1] == "poolfuzz: 2 passed, 0 failed"


def test_measurement_starts_before_the_engine_is_imported_and_misses_what_never_ran(tmp_path):
    code, reach = _measured_run(tmp_path, "--config", "dense")
    assert code == 0
    raw = json.loads((reach / "coverage.json").read_text())["files"]
    lines = {os.path.relpath(k, os.path.dirname(os.path.dirname(os.path.dirname(errors.__file__)))): v
             for k, v in raw.items()}
    # A class statement runs once, at import: executed only if the worker measured from its first line.
    assert _line_of(errors.PoolExhausted) in lines[f"{ENGINE}/errors.py"]["executed_lines"]
    # A fault that was not switched on, on a config it does not apply to: its body never ran.
    body = _body_lines(faults.EvictsOneTokenTooMany.evict_swa)
    assert body and body <= set(lines[f"{ENGINE}/faults.py"]["missing_lines"])
    # Every file of the engine's tree is in the report, none left out (a run loads all of poolfuzz's own modules
    # so that a seed draws the same examples in any process; an engine file no run imports would be reported at
    # 0%: SGLang's storage back-ends are, in CI's reach table).
    tree = Path(errors.__file__).parent
    assert {f"{ENGINE}/{p.relative_to(tree)}" for p in tree.rglob("*.py")} <= set(lines)


def test_a_family_without_engine_code_is_bad_usage(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = run_cli(["run", "--examples", "1", "--family", "tests.cover.minimal_family:build_minimal_family",
                    "--coverage", "reach"])
    err = capsys.readouterr().err
    assert code == 2 and "declares no engine code" in err and "'engine_code'" in err
    assert os.listdir(tmp_path) == []


def test_missing_coverage_is_bad_usage_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "coverage", None)  # import coverage raises ImportError
    assert run_cli(["run", "--examples", "1", "--config", "dense", "--coverage", "reach"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--coverage needs coverage.py" in err and "pip install" in err and "\n" not in err
    assert os.listdir(tmp_path) == []


def _executed(reach: Path) -> dict[str, set[int]]:
    raw = json.loads((reach / "coverage.json").read_text())["files"]
    return {os.path.basename(k): set(v["executed_lines"]) for k, v in raw.items()}


@pytest.mark.slow
def test_runs_added_into_one_directory_report_the_union_of_their_reach(tmp_path, capsys):
    """``--coverage-add``: each run's reach is added to what the directory holds (another family's runs, in real use),
    so the table is the union; without it, a run into the same directory starts afresh."""
    common = ["run", "--examples", "4", "--seed", "3", "--db", "none", "--out", str(tmp_path / "out")]
    alone = {}
    for config in ("dense", "mla"):
        assert run_cli([*common, "--config", config, "--coverage", str(tmp_path / config)]) == 0
        alone[config] = _executed(tmp_path / config)
    both = tmp_path / "both"
    assert run_cli([*common, "--config", "dense", "--coverage", str(both)]) == 0
    assert run_cli([*common, "--config", "mla", "--coverage", str(both), "--coverage-add"]) == 0
    added = _executed(both)
    for name in set(alone["dense"]) | set(alone["mla"]):
        assert added.get(name, set()) == alone["dense"].get(name, set()) | alone["mla"].get(name, set()), name
    assert added != alone["mla"] and added != alone["dense"]  # each brought lines the other lacks
    assert f"every run added into {both} combined" in capsys.readouterr().out
    assert run_cli([*common, "--config", "mla", "--coverage", str(both)]) == 0  # not added: afresh
    assert _executed(both) == alone["mla"]


def test_adding_to_the_reach_of_another_install_is_bad_usage(tmp_path, capsys):
    reach = tmp_path / "reach"
    reach.mkdir()
    (reach / "reach-code.json").write_text(json.dumps({"root": "/elsewhere", "entries": ["x/y"], "families": ["f"]}))
    code = run_cli(["run", "--config", "dense", "--examples", "1", "--db", "none", "--out", str(tmp_path / "out"),
                    "--coverage", str(reach), "--coverage-add"])
    assert code == 2
    assert "holds the reach of the engine under /elsewhere" in capsys.readouterr().err
    (reach / "reach-code.json").write_text("not json")
    assert run_cli(["run", "--config", "dense", "--examples", "1", "--db", "none", "--out", str(tmp_path / "out"),
                    "--coverage", str(reach), "--coverage-add"]) == 2
    assert "is not what an earlier measured run wrote" in capsys.readouterr().err
    (reach / "reach-code.json").unlink()
    (reach / ".coverage").write_bytes(b"")  # data no poolfuzz run recorded the engine code of
    assert run_cli(["run", "--config", "dense", "--examples", "1", "--db", "none", "--out", str(tmp_path / "out"),
                    "--coverage", str(reach), "--coverage-add"]) == 2
    assert "no poolfuzz run recorded the engine code of" in capsys.readouterr().err


def test_coverage_add_without_a_directory_is_bad_usage(capsys):
    assert run_cli(["run", "--config", "dense", "--examples", "1", "--coverage-add"]) == 2
    assert "give --coverage DIR too" in capsys.readouterr().err


def test_engine_code_the_installed_release_lacks_is_left_out_and_named():
    """A family declares its engine's code for every release it drives; an entry this install lacks (SGLang's
    ``scheduler_components`` before 0.5.13) is left out of the measurement and named, where a family none of whose
    entries is here has declared the wrong code."""
    from types import SimpleNamespace

    from poolfuzz.errors import UsageError
    from poolfuzz.orchestration.reach import engine_code_of

    def factory(config, **options):
        raise AssertionError("engine_code_of locates code without building a family")

    factory.engine_code = (ENGINE, "poolfuzz/no_such_subsystem")
    code = engine_code_of([SimpleNamespace(name="fake", target="tests:fake", factory=factory)])
    assert code.entries == (ENGINE,) and code.absent == ("poolfuzz/no_such_subsystem",)
    factory.engine_code = ("poolfuzz/no_such_subsystem",)
    with pytest.raises(UsageError, match="none of which is under"):
        engine_code_of([SimpleNamespace(name="fake", target="tests:fake", factory=factory)])
