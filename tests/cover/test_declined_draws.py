"""A run says how much it tested: drawn configs a family declines are counted apart (issue 32, item 7).

Drawn configs are drawn from what the family accepts (its ``unsupported_reason``) where the draw can be
steered, and the examples it still declines are reported as declined, never as passing examples; a
config tested less than asked is UNDER-TESTED, and ``--strict`` makes that exit 3.
"""

from __future__ import annotations

import sys
import types

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.pools.family import build_family


@pytest.fixture
def picky(monkeypatch):
    """Families over the builtin pools that decline most drawn configs: fp8 KV only, or 64-token pages only."""
    mod = types.ModuleType("picky_families")

    def factory(config, *, device="cpu", faults=(), backup_mode=None):
        return build_family(config, device=device, faults=faults, backup_mode=backup_mode)

    def fp8_only(config, *, device="cpu", faults=(), backup_mode=None):
        return factory(config, device=device, faults=faults, backup_mode=backup_mode)

    fp8_only.unsupported_reason = lambda c: None if c.kv_dtype.startswith("fp8") else f"{c.kv_dtype} KV is not fp8"

    def pages_of_64(config, *, device="cpu", faults=(), backup_mode=None):
        return factory(config, device=device, faults=faults, backup_mode=backup_mode)

    pages_of_64.unsupported_reason = lambda c: None if c.page_size == 64 else "only 64-token pages"
    mod.fp8_only, mod.pages_of_64 = fp8_only, pages_of_64
    monkeypatch.setitem(sys.modules, "picky_families", mod)
    return mod


def _run(tmp_path, family, *extra):
    return run_cli(["run", "--family", f"picky_families:{family}", "--config", "random", "--device", "cpu",
                    "--examples", "30", "--seed", "3", "--steps", "8", "--db", "none", "--out", str(tmp_path), *extra])


def _row(text: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith("random ")).split()


def test_draws_follow_what_the_family_accepts(picky, tmp_path, capsys):
    assert _run(tmp_path, "fp8_only", "--strict") == 0
    row = _row(capsys.readouterr().out)
    assert row[1] == "PASS"
    tested, declined = int(row[2].replace(",", "")), 0 if row[3] == "-" else int(row[3].replace(",", ""))
    assert tested > declined, row  # steered: most examples run (a draw-then-reject run declines 3 in 5)


def test_a_family_that_declines_most_draws_is_under_tested(picky, tmp_path, capsys):
    assert _run(tmp_path, "pages_of_64") == 0
    text = capsys.readouterr().out
    row = _row(text)
    assert row[1] == "UNDER-TESTED"
    assert int(row[3].replace(",", "")) > int(row[2].replace(",", ""))
    assert "declined by the family, most often: only 64-token pages" in text
    assert text.rstrip().endswith("(1 under-tested)")
    assert "0 passed, 0 failed" in text.splitlines()[-1]


def test_strict_makes_an_under_tested_run_exit_3(picky, tmp_path, capsys):
    assert _run(tmp_path, "pages_of_64", "--strict") == 3
    assert "tested less than asked (--strict: exit 3)" in capsys.readouterr().out
