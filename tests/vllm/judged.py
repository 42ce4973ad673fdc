"""The judged vLLM defects of the installed release (ci/known/vllm-VERSION.txt), passed over as --known does."""

from __future__ import annotations

from pathlib import Path

from poolfuzz.harness.failures import bug_key, signature_of
from poolfuzz.orchestration.known import known_on, load_known


def known_file(version: str) -> Path:
    """The installed release's judged defects, ``ci/known/vllm-VERSION.txt`` (it need not exist)."""
    return Path(__file__).resolve().parents[2] / "ci" / "known" / f"vllm-{version}.txt"


class PassOverJudged:
    """The machine's observer as ``poolfuzz run --known ci/known/vllm-VERSION.txt`` is: an example that fails with a
    judged vLLM defect of this release on this config is rejected and the search goes on; any other failure fails."""

    def __init__(self, version: str, config: str, *, also: tuple[str, ...] = ()):
        path = known_file(version)
        self.known = {bug_key(s) for s in known_on(load_known(str(path)), config)} if path.is_file() else set()
        self.known |= {bug_key(s) for s in also}  # a test's own: another symptom of the defect it plants
        self.passed_over = 0

    def example_started(self):
        pass

    def step_ran(self, machine):
        pass

    def example_ended(self, machine):
        pass

    def example_failed(self, machine, exc, program, in_teardown) -> bool:
        known = bug_key(signature_of(exc, in_teardown=in_teardown, op=machine.op)) in self.known
        self.passed_over += known
        return known
