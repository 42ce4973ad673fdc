"""``poolfuzz bench``: runs end to end at tiny sizes and writes every figure the issue asks for.

Nothing here judges speed (that is what the bench is for); it checks the wiring, the keys, the
table and the arguments.
"""

import json

import pytest

from poolfuzz.orchestration import bench
from poolfuzz.cli import run_cli
from poolfuzz.pools.config import CONFIGS

REQUIRED = ["checksum_gbps", "sum_gbps", "checksum_ratio", "steps_per_second", "steps_per_second_large",
            "scaling_ratio", "seconds_to_first_failure", "steps_per_second_drawn"]


@pytest.fixture
def tiny(monkeypatch):
    """A million slots is the real figure; a few thousand keep this test quick."""
    monkeypatch.setattr(bench, "SMALL_TOKENS", 1 << 8)
    monkeypatch.setattr(bench, "LARGE_TOKENS", 1 << 12)


def test_bench_writes_every_figure(tiny, tmp_path, capsys):
    """The JSON holds every required key with a positive number, plus the threads it used."""
    out = tmp_path / "bench.json"
    assert run_cli(["bench", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for key in REQUIRED:
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert figures["checksum_ratio"] == pytest.approx(figures["checksum_gbps"] / figures["sum_gbps"])
    assert figures["scaling_ratio"] == pytest.approx(figures["steps_per_second_large"] / figures["steps_per_second"])
    assert figures["bandwidth_threads"] == 1 and figures["device"] == "cpu"
    assert figures["token_slots"] == 1 << 8 and figures["token_slots_large"] == 1 << 12
    assert figures["token_slots_builtin"] == CONFIGS["swa-ssm"].full_tokens and figures["steps_per_second_builtin"] > 0
    assert set(figures["targets"]) == {"checksum_ratio", "steps_per_second", "scaling_ratio",
                                       "seconds_to_first_failure"}
    table = capsys.readouterr().out
    for key in REQUIRED:
        assert key in table
    assert "1 thread" in table


def test_bandwidth_figures_at_a_chosen_thread_count():
    """The bandwidth pass reports the thread count it ran with and restores the caller's."""
    import torch

    before = torch.get_num_threads()
    figures = bench.bandwidth(torch.device("cpu"), mib=1, row_bytes=4096, reps=1, threads=2)
    assert figures["bandwidth_threads"] == 2 and figures["buffer_bytes"] == 1 << 20
    assert torch.get_num_threads() == before


def test_verdicts_name_each_target_met_or_missed():
    """Targets apply per device type and say whether they were met."""
    got = bench.verdicts({"checksum_ratio": 0.4, "scaling_ratio": 0.9, "seconds_to_first_failure": 3.0}, "cpu")
    assert got["checksum_ratio"]["met"] is False
    assert got["scaling_ratio"]["met"] is True and got["seconds_to_first_failure"]["met"] is True
    assert "checksum_vs_copy" not in got


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--row-bytes", "12"], ["--examples", "0"], ["--step-reps", "0"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    """Impossible sizes exit 2 with one line, before anything runs."""
    assert run_cli(["bench", *argv]) == 2
    assert "poolfuzz: error:" in capsys.readouterr().err
