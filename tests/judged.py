"""The judged defects of an installed engine release (ci/known/ENGINE-VERSION.txt, or the file of the releases it lies
in, ENGINE-FIRST-LAST.txt), passed over as --known does."""

from __future__ import annotations

from pathlib import Path

from poolfuzz.harness.failures import bug_key, signature_of
from poolfuzz.orchestration.known import known_on, load_known


def known_file(engine: str, version: str) -> Path:
    """The release's judged defects: ``ci/known/ENGINE-VERSION.txt``, else the file of the releases it lies in,
    ``ci/known/ENGINE-FIRST-LAST.txt`` (``sglang-0.5.18-0.5.22.txt`` for 0.5.21; a post release counts as its
    release); the release's own name where neither exists."""
    from packaging.version import InvalidVersion, Version

    known = Path(__file__).resolve().parents[1] / "ci" / "known"
    own = known / f"{engine}-{version}.txt"
    if own.is_file():
        return own
    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        return own
    for path in sorted(known.glob(f"{engine}-*-*.txt")):
        first, _, last = path.stem[len(engine) + 1:].partition("-")
        try:
            if Version(first) <= release <= Version(last):
                return path
        except InvalidVersion:
            continue
    return own


def judged_signatures(engine: str, version: str, config: str, *, family: str | None = None) -> tuple:
    """The signatures the release's judged list (``known_file``) names for ``config`` (through ``family``, where the
    list says); none where the release has no list."""
    path = known_file(engine, version)
    return tuple(known_on(load_known(str(path)), config, family)) if path.is_file() else ()


class PassOverJudged:
    """The machine's observer as ``poolfuzz run --family FAMILY --known ci/known/ENGINE-VERSION.txt`` is: an example
    that fails with a judged defect of this release on this config (through this family, where the list says) is
    rejected and the search goes on; any other failure fails."""

    def __init__(self, engine: str, version: str, config: str, *, family: str | None = None,
                 also: tuple[str, ...] = ()):
        self.known = {bug_key(s) for s in judged_signatures(engine, version, config, family=family)}
        self.known |= {bug_key(s) for s in also}  # a test's own: another symptom of the defect it plants
        self.passed_over = 0

    def example_started(self):
        pass

    def step_ran(self, machine):
        pass

    def example_ended(self, machine):
        pass

    def example_declined(self, config, reason):
        pass

    def example_failed(self, machine, exc, program, in_teardown) -> bool:
        known = bug_key(signature_of(exc, in_teardown=in_teardown, op=machine.op)) in self.known
        self.passed_over += known
        return known
