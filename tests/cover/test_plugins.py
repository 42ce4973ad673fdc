"""Family plug-ins: ``--family`` resolves shipped names, entry points and module paths."""

from __future__ import annotations

import os
import sys
import types
from importlib import metadata

import pytest

from poolfuzz.orchestration import plugins
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.family import build_family


@pytest.fixture
def toy_module(monkeypatch):
    """An importable module with a factory that wraps the builtin family and declines swa."""
    mod = types.ModuleType("toy_families")
    calls = []

    def factory(config, *, device="cpu", faults=(), backup_mode=None):
        calls.append(config.name)
        return build_family(config, device=device, faults=faults, backup_mode=backup_mode)

    factory.unsupported_reason = lambda c: "toy pools have no sliding window" if c.has_swa else None
    mod.factory = factory
    mod.nested = types.SimpleNamespace(factory=factory)
    mod.not_callable = 3
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "toy_families", mod)
    return mod


class TestResolve:
    def test_default_is_the_builtin_family(self):
        plugin = plugins.resolve_family(None)
        assert plugin.factory is build_family and plugin.origin == "shipped"

    def test_module_path_with_dotted_attribute(self, toy_module):
        assert plugins.resolve_family("toy_families:nested.factory").factory is toy_module.factory

    def test_sglang_is_shipped_and_lazy(self):
        """Resolving an SGLang family imports the adapter but not SGLang itself."""
        plugin = plugins.resolve_family("sglang:scheduler")
        assert plugin.target == "poolfuzz.adapters.sglang:build_scheduler_driver"
        assert callable(plugin.factory.unsupported_reason)

    def test_a_suite_names_every_sglang_server_and_not_the_pools_path(self):
        members = plugins.resolve_members("sglang")
        assert [p.name for p in members] == ["sglang:scheduler", "sglang:hicache", "sglang:decode",
                                             "sglang:unified-server", "sglang:unified-decode"]
        assert all(p.drives_scheduler for p in members)
        assert plugins.family_members("sglang:decode") == ("sglang:decode",)
        assert plugins.family_members(None) == (plugins.DEFAULT_FAMILY,)
        assert plugins.installed_families()["sglang"] == ("suite(sglang:scheduler, sglang:hicache, sglang:decode, "
                                                                "sglang:unified-server, sglang:unified-decode)")

    def test_a_question_for_one_family_asked_of_a_suite_names_its_members(self):
        with pytest.raises(ConfigError, match=r"'sglang' names several families \(sglang:scheduler, sglang:hicache, "
                                              r"sglang:decode, sglang:unified-server, sglang:unified-decode\)"
                                              r".*--family sglang:scheduler"):
            plugins.resolve_family("sglang")

    def test_a_retired_family_names_what_runs_its_path_now(self):
        """``sglang:unified`` (the pools path's restated unified admission) was deleted once SGLang's own scheduler
        ran that pool: typing it, or replaying an artifact recorded on it, names the servers, and it is not listed."""
        with pytest.raises(ConfigError, match=r"'sglang:unified' was retired; .*--family sglang:unified-server"):
            plugins.resolve_family("sglang:unified")
        with pytest.raises(ConfigError, match=r"recorded on pool family 'sglang:unified', which was retired"):
            plugins.resolve_recorded("sglang:unified", trusted="sglang:unified")
        stale = metadata.EntryPoint(name="sglang:unified", value="poolfuzz.adapters.sglang:build_unified_family",
                                    group=plugins.ENTRY_POINT_GROUP)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plugins, "_entry_points", lambda: [stale])
            assert "sglang:unified" not in plugins.installed_families()

    def test_the_pools_path_is_retired_and_its_old_names_say_what_runs_it_now(self):
        """``sglang:pools`` (the adapter's admission and frees over SGLang's pools) was deleted once SGLang's own
        servers drove every mode it ran; an engine program recorded as ``sglang`` ran there, and says so too."""
        assert "sglang:pools" not in plugins.installed_families()
        with pytest.raises(ConfigError, match=r"'sglang:pools' was retired; its path now runs as --family sglang \("):
            plugins.resolve_family("sglang:pools")
        assert plugins.ENGINE_PROGRAMS_OF["sglang"] == "sglang:pools"
        with pytest.raises(ConfigError, match=r"recorded on pool family 'sglang:pools', which was retired"):
            plugins.resolve_recorded("sglang:pools")

    def test_entry_point_group(self, toy_module, monkeypatch):
        ep = metadata.EntryPoint(name="toy", value="toy_families:factory", group=plugins.ENTRY_POINT_GROUP)
        monkeypatch.setattr(plugins, "_entry_points", lambda: [ep])
        plugin = plugins.resolve_family("toy")
        assert plugin.factory is toy_module.factory and plugin.origin.startswith("entry point")
        assert plugins.installed_families()["toy"] == "toy_families:factory"

    @pytest.mark.parametrize("spec, words", [
        ("nope", "unknown pool family 'nope'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("toy_families:missing", "has no attribute 'missing'"),
        ("toy_families:not_callable", "not a callable factory"),
        ("toy_families:", "package.module:factory"),
    ])
    def test_errors_say_what_to_do(self, toy_module, spec, words):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            plugins.resolve_family(spec)


class TestSelectConfigs:
    def test_declined_configs_are_skipped_with_their_reason(self, toy_module):
        plugin = plugins.resolve_family("toy_families:factory")
        chosen, skipped = plugins.select_configs(plugin, [CONFIGS["dense"], CONFIGS["swa"]], explicit=False)
        assert [c.name for c in chosen] == ["dense"]
        assert skipped == [("swa", "toy pools have no sliding window")]

    def test_a_declined_explicit_config_is_an_error(self, toy_module):
        plugin = plugins.resolve_family("toy_families:factory")
        with pytest.raises(ConfigError, match="does not support config 'swa'"):
            plugins.select_configs(plugin, [CONFIGS["swa"]], explicit=True)


def cpu_tensor_only(config, *, device="cpu", faults=(), backup_mode=None):
    """Pools that back retractions up in CPU tensors only, as the sglang family does."""
    if backup_mode not in (None, "cpu_tensor"):
        raise ConfigError(f"only cpu_tensor retraction here, not {backup_mode!r}")
    return build_family(config, device=device, faults=faults, backup_mode="cpu_tensor")


def test_a_plug_in_failure_records_the_backup_mode_it_ran_with(tmp_path):
    """dense would take host_pool as built in; the record must name the plug-in's own path, or a
    replay builds the family with a mode it refuses and 'reproduces' that error instead."""
    from poolfuzz.orchestration.runner import run_machine

    assert build_family(CONFIGS["dense"]).backup_mode == "host_pool"
    result = run_machine(CONFIGS["dense"], faults=["backup-drops-last-token"], family_factory=cpu_tensor_only,
                         max_examples=50, shrink_limit=0)
    assert not result.passed and result.backup_mode == "cpu_tensor"
    assert run_machine(CONFIGS["dense"], family_factory=cpu_tensor_only, max_examples=3).backup_mode == "cpu_tensor"


@pytest.mark.parametrize("factory, words", [
    (lambda config, **kw: object(), "returned a object, not a pool family (it lacks backup_mode, components"),
    (lambda config, **kw: 1 / 0, "cannot build config 'dense' on cpu: ZeroDivisionError: division by zero"),
])
def test_a_factory_that_builds_no_family_is_bad_usage_not_a_found_failure(factory, words, tmp_path, monkeypatch,
                                                                          capsys):
    """Exit 2 and nothing written: no artifact, no database entry, no FAIL line."""
    from poolfuzz.cli import run_cli

    mod = types.ModuleType("broken_families")
    mod.factory = factory
    monkeypatch.setitem(sys.modules, "broken_families", mod)
    monkeypatch.chdir(tmp_path)
    assert run_cli(["run", "--family", "broken_families:factory", "--config", "dense", "--examples", "1"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "family 'broken_families:factory'" in err and words in err
    assert "FAIL" not in captured.out and os.listdir(tmp_path) == []


@pytest.fixture
def toy_suite(toy_module, monkeypatch):
    """A suite of two toy families: ``toy_families:factory`` (no sliding window) and ``toy_families:leaky``, whose
    backup drops a request's last token on dense."""

    def leaky(config, *, device="cpu", faults=(), backup_mode=None):
        mine = ("backup-drops-last-token",) if config.name == "dense" else ()
        return build_family(config, device=device, faults=mine, backup_mode=backup_mode)

    toy_module.leaky = leaky
    monkeypatch.setitem(plugins.SUITES, "toy", ("toy_families:factory", "toy_families:leaky"))
    return toy_module


def _suite_run(tmp_path, *extra):
    from poolfuzz.cli import run_cli

    return run_cli(["run", "--family", "toy", "--config", "dense", "swa", "--examples", "40", "--seed", "1",
                    "--db", "none", "--out", str(tmp_path / "out"), "--shrink-seconds", "5", *extra])


def test_a_suite_runs_each_config_through_every_member_that_takes_it(toy_suite, tmp_path, capsys):
    from poolfuzz.orchestration.artifacts import load

    assert _suite_run(tmp_path) == 1
    out = capsys.readouterr().out
    assert "poolfuzz: family toy_families:factory skips swa: toy pools have no sliding window" in out
    assert "2 config(s) through 2 families of toy (3 lanes)" in out
    table = {line.split()[0]: line.split()[1] for line in out.splitlines()
             if line.startswith("toy_families:") and "/" in line.split()[0] and len(line.split()) > 2}
    assert table == {"toy_families:factory/dense": "PASS", "toy_families:leaky/dense": "FAIL",
                     "toy_families:leaky/swa": "PASS"}
    (path,) = (tmp_path / "out").glob("*.json")
    art = load(path)
    assert "toy_families-leaky" in path.name and art.family == "toy_families:leaky" and art.config == "dense"


def test_a_suites_known_list_names_the_member_a_bug_is_known_through(toy_suite, tmp_path, capsys):
    assert _suite_run(tmp_path) == 1
    from poolfuzz.orchestration.artifacts import load

    (path,) = (tmp_path / "out").glob("*.json")
    signature = load(path).signature
    capsys.readouterr()
    known = tmp_path / "known.txt"
    known.write_text(f"toy_families:factory dense {signature}\n")  # another member: still a finding
    assert _suite_run(tmp_path / "again", "--known", str(known)) == 1
    capsys.readouterr()
    known.write_text(f"toy_families:leaky dense {signature}\n")
    assert _suite_run(tmp_path / "third", "--known", str(known)) == 0
    out = capsys.readouterr().out
    assert "known failures passed over" in out and signature in out


def test_a_named_config_no_member_runs_is_bad_usage(toy_suite, monkeypatch, capsys):
    from poolfuzz.cli import run_cli

    monkeypatch.setitem(plugins.SUITES, "toy", ("toy_families:factory",))
    assert run_cli(["run", "--family", "toy", "--config", "swa", "--examples", "1", "--db", "none"]) == 2
    assert "no family of 'toy' (toy_families:factory) runs config 'swa' here" in capsys.readouterr().err


def test_doctor_on_a_suite_says_which_member_runs_each_config(toy_suite, capsys):
    from poolfuzz.cli import run_cli

    assert run_cli(["doctor", "--family", "toy"]) == 0
    out = capsys.readouterr().out
    assert "family: toy_families:factory (toy_families:factory, module path)" in out
    assert "family: toy_families:leaky (toy_families:leaky, module path)" in out
    assert out.count("engine: none") == 1  # one report for members over one engine (here: none)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["swa"].endswith("runs on toy_families:leaky")
    assert lines["dense"].endswith("runs on toy_families:factory, toy_families:leaky")
    assert "verdict: OK" in out


def test_a_shipped_familys_build_that_crashes_is_the_engines_failure_not_bad_usage():
    """A shipped family drives an engine: its build raising is the engine crashing at startup (SGLang 0.5.12's FP4
    decode server), which the examples report and a replay reproduces; the same raise from a plug-in's factory is
    still bad usage naming the factory. A shipped family's own refusal (ConfigError) still stops the run."""
    def crashes(config, *, device="cpu", faults=(), backup_mode=None):
        raise OSError(22, "Invalid argument")

    def refuses(config, *, device="cpu", faults=(), backup_mode=None):
        raise ConfigError("the server refuses it")

    shipped = plugins.FamilyPlugin(name="sglang:hicache", target="x:crashes", origin=plugins.SHIPPED_ORIGIN,
                                   factory=crashes)
    assert plugins.probe_family(shipped, CONFIGS["dense"]) is None
    plug_in = plugins.FamilyPlugin(name="mine", target="mine:crashes", origin="module path", factory=crashes)
    with pytest.raises(ConfigError, match=r"cannot build config 'dense' on cpu: OSError.*pass a factory"):
        plugins.probe_family(plug_in, CONFIGS["dense"])
    refused = plugins.FamilyPlugin(name="sglang:hicache", target="x:refuses", origin=plugins.SHIPPED_ORIGIN,
                                   factory=refuses)
    with pytest.raises(ConfigError, match="the server refuses it"):
        plugins.probe_family(refused, CONFIGS["dense"])


def test_a_replayed_server_that_crashes_while_it_starts_is_the_recorded_failure():
    """A scheduler-program artifact recorded at the server's start (``Crash:OSError@init``) replays to the same
    failure, judged at the operation the run recorded it under (before: "@teardown", a different failure)."""
    import io

    from poolfuzz.cli.replay import _replay_scheduled

    def crashes(config, *, device="cpu", faults=(), backup_mode=None):
        raise OSError(22, "Invalid argument")

    art = types.SimpleNamespace(program=[], backup_mode=None, failure="OSError: [Errno 22] Invalid argument",
                                signature="Crash:OSError@init", error_type="OSError", divergence=None)
    out = io.StringIO()
    assert _replay_scheduled(out.write, art, CONFIGS["dense"], "cpu", crashes) == 1
    assert "REPRODUCED at building the server" in out.getvalue()
    assert out.getvalue().rstrip().endswith("the same failure as recorded"), out.getvalue()
