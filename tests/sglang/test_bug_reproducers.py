"""The standalone reproducers in docs/bugs/ against the installed SGLang: each one's verdict for this release.

Each reproducer runs in a subprocess with this interpreter, as a user runs it (it imports only torch, SGLang and
the standard library, so it does not need poolfuzz). EXPECTED records what each printed on the releases it was run
on; a release newer than the table is expected to behave as the newest entry, so the day a release fixes a defect
this test fails, and the table and the report's status get updated. As in conftest.py: SGLang missing skips, unless
POOLFUZZ_SGLANG_EXPECT says CI installed it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BUGS = Path(__file__).resolve().parents[2] / "docs" / "bugs"

# reproducer -> [(first release, verdict from there on)], ascending. Run on 0.5.9 and 0.5.12 - 0.5.23 (0.5.10 and
# 0.5.11 inferred; docs/bugs/*.md, "Releases affected"). A verdict of None would mean: not recorded there, skip.
EXPECTED = {
    "sglang-mha-fp4-scales": [("0.5.9", "REPRODUCED")],
    "sglang-mla-fp4-scales": [("0.5.9", "REPRODUCED")],
    "sglang-minimax-konly-cpu-copy": [("0.5.9", "NOT APPLICABLE"), ("0.5.15", "REPRODUCED")],
    # page_head came in 0.5.13; run on every release from 0.5.9 to 0.5.23 (stop 63)
    "sglang-hicache-page-head-views": [("0.5.9", "NOT APPLICABLE"), ("0.5.13", "REPRODUCED")],
}
EXIT = {"REPRODUCED": 1, "NOT REPRODUCED": 0, "NOT APPLICABLE": 0}
FIRST = "0.5.9"  # the oldest release the table covers


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


@pytest.fixture(scope="module")
def release() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("POOLFUZZ_SGLANG_EXPECT"):
            pytest.fail("POOLFUZZ_SGLANG_EXPECT is set but SGLang is not installed here")
        pytest.skip("SGLang is not installed in this environment; CI runs these in its SGLang venvs")


def expected_verdict(stem: str, release: str) -> str | None:
    verdict = None
    for first, then in EXPECTED[stem]:
        if _release(release) >= _release(first):
            verdict = then
    return verdict


def _run(stem: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUGS / f"{stem}.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BUGS)


@pytest.fixture(scope="module")
def runs(release):
    """Every reproducer's run on this release (on the CPU), side by side: each spends its time importing SGLang."""
    with ThreadPoolExecutor(len(EXPECTED)) as pool:
        return dict(zip(EXPECTED, pool.map(_run, EXPECTED)))


def _check(stem: str, release: str, done: subprocess.CompletedProcess) -> None:
    if _release(release) < _release(FIRST):
        pytest.skip(f"no verdicts recorded before SGLang {FIRST}")
    want = expected_verdict(stem, release)
    if want is None:
        pytest.skip(f"{stem}: no verdict recorded for SGLang {release}")
    lines = done.stdout.splitlines()
    first = lines[0] if lines else ""
    got = first.split(":", 1)[0]
    assert (got, done.returncode) == (want, EXIT[want]), (
        f"{stem} on SGLang {release}: expected {want} (exit {EXIT[want]}), got exit {done.returncode}\n"
        f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("stem", list(EXPECTED))
def test_the_reproducer_gives_the_recorded_verdict(stem, release, runs):
    _check(stem, release, runs[stem])


@pytest.mark.requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("stem", list(EXPECTED))
def test_the_reproducer_gives_the_same_verdict_on_cuda(stem, release):
    _check(stem, release, _run(stem, "--device", "cuda"))


@pytest.mark.parametrize("stem", list(EXPECTED))
def test_cuda_asked_without_cuda_is_a_one_line_error(stem):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    done = _run(stem, "--device", "cuda", timeout=120)
    assert done.returncode == 2
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["error: --device cuda, but this torch sees no usable CUDA device"]


@pytest.mark.parametrize("stem", list(EXPECTED))
def test_bad_usage_is_refused_with_the_usage(stem):
    done = _run(stem, "--device", "tpu", timeout=120)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "invalid choice: 'tpu'" in done.stderr and "Traceback" not in done.stderr
