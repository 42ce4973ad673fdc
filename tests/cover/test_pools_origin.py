"""A run says who built the pools its examples ran on (issue 35: drawn configs and the adapter's wiring).

A family declares ``pools_origin`` (poolfuzz's own pools, the engine's own code for the config's server, or the
adapter's wiring of the engine's classes); a run counts its examples by it and names, per config, how many ran on
the wiring and why; an artifact records the failing example's, and a replay on other pools says so.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.errors import ConfigError
from poolfuzz.orchestration.display import pools_lines
from poolfuzz.pools.capabilities import PoolsOrigin, capabilities_of, nodes_pools_origin
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family

ENGINE = PoolsOrigin(built_by="engine", detail="the server's configurator")
WIRED = PoolsOrigin(built_by="adapter", detail="no server builds these")


def test_an_origin_names_one_of_the_three_builders():
    with pytest.raises(ConfigError, match="built_by must be one of poolfuzz, engine, adapter"):
        PoolsOrigin(built_by="vendor", detail="x")


def test_a_family_declaring_something_else_as_its_origin_is_refused_when_built():
    family = build_family(CONFIGS["dense"])
    family.pools_origin = "engine"  # an instance attribute shadows the class's PoolsOrigin
    with pytest.raises(ConfigError, match="pools_origin must be a PoolsOrigin"):
        capabilities_of(family)


def test_an_example_is_on_the_engines_pools_only_where_every_node_is():
    assert nodes_pools_origin({"prefill": ENGINE, "decode": ENGINE}) == ENGINE
    mixed = nodes_pools_origin({"prefill": ENGINE, "decode": WIRED})
    assert mixed == PoolsOrigin(built_by="adapter", detail="decode node: no server builds these")
    assert nodes_pools_origin({"prefill": ENGINE, "decode": None}) is None  # a node whose family does not say


def _lane(pools: dict):
    from poolfuzz.orchestration.display import LaneState

    return LaneState(lane=None, pools=pools)


def test_the_summary_names_the_configs_on_the_wiring_and_why():
    lines = pools_lines({"dense": [_lane({"engine": {"flags": 10}})],
                         "random": [_lane({"engine": {"flags": 2}, "adapter": {"no model": 5, "other sizes": 3}})]})
    assert lines == ["who built the pools the examples ran on: the engine's own code 12, the adapter's wiring 8",
                     "  random: 8 of 10 on the adapter's wiring, most often: no model"]
    same = pools_lines({"a": [_lane({"adapter": {"groups laid out": 4}})], "b": [_lane({"adapter": {"groups laid out": 6}})]})
    assert same == ["who built the pools the examples ran on: the adapter's wiring 10",
                    "  every config on the adapter's wiring: groups laid out"]
    assert pools_lines({"dense": [_lane({"poolfuzz": {"own": 9}})]}) == []  # the built-in family: nothing to say


@pytest.fixture
def engine_built(monkeypatch):
    """A family over the built-in pools with #35957's fault, whose prefill node says the engine built it and whose
    decode node says the adapter wired it (a stand-in for a plug-in whose nodes differ)."""
    mod = types.ModuleType("origin_families")

    def factory(config, *, device="cpu", faults=(), backup_mode=None, node="prefill"):
        family = build_family(config, device=device, faults=("swa-ignores-mamba-backup",), backup_mode=backup_mode)
        family.pools_origin = ENGINE if node == "prefill" else WIRED
        return family

    factory.builds_per_node = True
    mod.factory = factory
    monkeypatch.setitem(sys.modules, "origin_families", mod)
    return mod


def test_a_run_counts_its_examples_by_who_built_the_pools_and_records_it(engine_built, tmp_path, capsys):
    code = run_cli(["run", "--family", "origin_families:factory", "--config", "swa-ssm", "--device", "cpu",
                    "--examples", "20", "--seed", "1", "--db", "none",
                    "--out", str(tmp_path)])
    assert code == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("who built the pools"))
    ran = int(lines[at].rsplit(" ", 1)[1].replace(",", ""))
    assert lines[at] == f"who built the pools the examples ran on: the adapter's wiring {ran:,}"  # every example
    assert lines[at + 1] == (f"  swa-ssm: {ran:,} of {ran:,} on the adapter's wiring, most often: decode node: no server "
                             "builds these")
    (artifact,) = tmp_path.glob("*.json")
    raw = json.loads(artifact.read_text())
    assert raw["pools"] == {"built_by": "adapter", "detail": "decode node: no server builds these"}
    raw["pools"] = {"built_by": "engine", "detail": "the server's configurator"}
    artifact.write_text(json.dumps(raw))
    assert run_cli(["replay", str(artifact), "--device", "cpu", "--family", "origin_families:factory"]) == 1
    out = capsys.readouterr().out
    assert "pools: the adapter's wiring (decode node: no server builds these)" in out
    assert "recorded on other pools: the engine's own code (the server's configurator)" in out


def test_an_artifact_written_before_origins_were_recorded_still_replays(tmp_path, capsys):
    from poolfuzz.orchestration.artifacts import dumps, from_program

    raw = json.loads(dumps(from_program("swa-ssm", [{"op": "admit", "args": {"prompt_len": 9}},
                                                     {"op": "prefill", "args": {"rid": 1, "chunk": 9}},
                                                     {"op": "retract", "args": {"rid": 1}},
                                                     {"op": "admit", "args": {"prompt_len": 4}},
                                                     {"op": "prefill", "args": {"rid": 2, "chunk": 4}},
                                                     {"op": "resume", "args": {"node": "prefill"}}],
                                        faults=["swa-ignores-mamba-backup"])))
    assert raw["pools"] == {"built_by": "poolfuzz", "detail": "poolfuzz's own pools, with SGLang's semantics"}
    del raw["pools"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert run_cli(["replay", str(path), "--device", "cpu"]) == 1
    assert "pools:" not in capsys.readouterr().out  # the built-in family's own pools go unsaid
