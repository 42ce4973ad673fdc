"""An engine API change is never a finding: "API CHANGED", exit 2, no artifact (issue 32).

A fake engine module (``fakeengine``) stands for a release; a family over the builtin pools reads
one attribute of it on every extend through ``engine_api.checked_attr``, as the real adapters read
through their compatibility modules, and declares what it needs for ``doctor`` and ``run``'s check.
"""

from __future__ import annotations

import sys
import types

import pytest

from poolfuzz.adapters.engine_api import Need, checked_attr, report
from poolfuzz.cli import run_cli
from poolfuzz.errors import EngineApiChanged, api_change_in
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family

NEEDS = (Need(target="fakeengine:Pool.free_count", used_for="free counts"),
         Need(target="fakeengine:Pool.defrag", required=False, used_for="defragmentation (absent: skipped)"))


class _Pool:
    """The fake engine's pool class: the family reads ``free_count`` of it on every extend."""

    free_count = 1


@pytest.fixture
def engine(monkeypatch):
    mod = types.ModuleType("fakeengine")
    mod.Pool = _Pool
    monkeypatch.setitem(sys.modules, "fakeengine", mod)
    monkeypatch.setattr(_Pool, "free_count", 1, raising=False)

    class Reading:
        """The builtin protocol, with the extend that reads the fake engine's pool."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def extend(self, *args, **kwargs):
            checked_attr(mod.Pool, "free_count", engine="fakeengine", release="9.9", expected="a free count",
                         owner="Pool")
            return self.inner.extend(*args, **kwargs)

    def factory(config, *, device="cpu", faults=(), backup_mode=None):
        family = build_family(config, device=device, faults=faults, backup_mode=backup_mode)
        family.protocol = Reading(family.protocol)
        return family

    factory.engine_report = lambda: report(NEEDS, engine="fakeengine", release="9.9")
    mod.factory = factory
    return mod


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    argv = ["run", "--family", "fakeengine:factory", "--config", "dense", "--device", "cpu", "--examples", "20",
            "--seed", "3", "--db", "none", "--out", str(out), *extra]
    return run_cli(argv), out


def test_the_family_runs_while_the_engine_has_what_it_reads(engine, tmp_path, capsys):
    code, out = _run(tmp_path)
    assert code == 0, capsys.readouterr()
    assert "API CHANGED" not in capsys.readouterr().out


def test_an_attribute_gone_before_the_run_is_refused_before_fuzzing(engine, tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(_Pool, "free_count")
    code, out = _run(tmp_path)
    err = capsys.readouterr().err
    assert code == 2
    assert "API CHANGED: fakeengine 9.9: fakeengine:Pool.free_count: expected present, found no such attribute" in err
    assert not out.exists() or not any(out.iterdir())


def test_an_attribute_gone_mid_run_stops_the_config_untested(engine, tmp_path, capsys, monkeypatch):
    """The doctor's probes pass (the report is taken first), then the read inside a step fails."""
    monkeypatch.setattr(engine.factory, "engine_report", lambda: report(NEEDS[1:], engine="fakeengine", release="9.9"))
    monkeypatch.delattr(_Pool, "free_count")
    code, out = _run(tmp_path)
    text = capsys.readouterr().out
    assert code == 2
    assert "API CHANGED: fakeengine 9.9: Pool.free_count: expected a free count, found no such attribute" in text
    assert "API CHANGED" in next(line for line in text.splitlines() if line.startswith("dense "))
    assert "untested" in text.splitlines()[-1]
    assert not any(p.suffix == ".json" for p in out.rglob("*")), "an API change wrote a failure artifact"


def test_doctor_names_what_is_missing_and_exits_2(engine, capsys, monkeypatch):
    assert run_cli(["doctor", "--family", "fakeengine:factory"]) == 0
    text = capsys.readouterr().out
    assert "engine: fakeengine 9.9" in text and f"configs: {len(CONFIGS)} of {len(CONFIGS)} run here" in text
    assert "absent   optional fakeengine:Pool.defrag" in text
    monkeypatch.delattr(_Pool, "free_count")
    assert run_cli(["doctor", "--family", "fakeengine:factory"]) == 2
    text = capsys.readouterr().out
    assert "absent   needed   fakeengine:Pool.free_count" in text
    assert text.rstrip().endswith("expected present, found no such attribute; the fakeengine adapter needs updating "
                                  "for this release (see `poolfuzz doctor --family fakeengine`)")


def test_a_wrapped_api_change_is_still_one():
    change = EngineApiChanged(engine="e", release="1", attribute="A.b", expected="x", found="y")
    try:
        try:
            raise change
        except EngineApiChanged as exc:
            raise RuntimeError("the engine call failed") from exc
    except RuntimeError as outer:
        assert api_change_in(outer) is change
    assert api_change_in(ValueError("no")) is None


def test_a_reshaped_callable_is_changed_not_absent(engine, monkeypatch):
    monkeypatch.setattr(_Pool, "resize", lambda self, size: None, raising=False)
    need = Need(target="fakeengine:Pool.resize", params=("self", "size", "device"))
    (probe,) = report((need,), engine="fakeengine", release="9.9").probes
    assert probe.status == "changed" and "without device" in probe.found


@pytest.fixture
def artifact(tmp_path):
    """A real failure artifact (#35957 on the builtin pools), recorded as if on the fake engine's family."""
    import json

    out = tmp_path / "found"
    assert run_cli(["run", "--config", "swa-ssm", "--faults", "swa-ignores-mamba-backup", "--device", "cpu",
                    "--examples", "200", "--seed", "1", "--db", "none", "--out", str(out),
                    "--shrink-seconds", "5"]) == 1
    (path,) = out.glob("*.json")
    art = json.loads(path.read_text())
    art["family"] = "fakeengine:factory"
    path.write_text(json.dumps(art))
    return path


def test_a_replay_on_a_changed_engine_is_neither_reproduced_nor_fixed(engine, artifact, capsys, monkeypatch):
    argv = ["replay", str(artifact), "--family", "fakeengine:factory", "--device", "cpu"]
    assert run_cli(argv) == 1  # the engine as recorded: the failure reproduces
    capsys.readouterr()
    monkeypatch.setattr(engine.factory, "engine_report", lambda: report(NEEDS[1:], engine="fakeengine", release="9.9"))
    monkeypatch.delattr(_Pool, "free_count")
    assert run_cli(argv) == 2  # found inside a replayed step: not a reproduction
    captured = capsys.readouterr()
    assert "API CHANGED: fakeengine 9.9: Pool.free_count" in captured.err
    assert "REPRODUCED" not in captured.out and "did not reproduce" not in captured.out
