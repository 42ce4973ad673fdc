"""Every catalogue fault is found on every config it applies to, within a fixed modest budget.

Seeded (hunt's first seed), shrinking cut short: this suite asks "is it found, and what does
poolfuzz say", not "how fast" (that is ``poolfuzz hunt``'s matrix). An explicit seed, not
derandomization: a derandomized run draws from a stream keyed by the machine class's digest, which
any refactoring of the machine changes.
"""

import re

import pytest

from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.faults import FAULTS, applicable_configs

BUDGET = 300

# What the report must name for each fault: the failure class and the words that point at the bug.
SIGNATURES = {
    "swa-ignores-mamba-backup": r"^StateLost: .*component mamba\.",
    "host-pool-for-ssm": r"^InvariantViolation: .*host_pool retraction backup chosen for a model with recurrent state",
    "mamba-backed-up-twice": r"^InvariantViolation: .*recurrent state backed up twice",
    "mamba-slot-zero": r"^InvariantViolation: .*mamba free list holds the reserved slot/page 0",
    "mamba-not-cleared": r"^StateLost: .*component mamba\.",
    "backup-drops-last-token": r"^ReferenceMismatch: .*retraction backup holds \d+ tokens; the seqlen-1 contract",
    "backup-includes-unwritten-token": r"(retraction backup holds \d+ tokens; the seqlen-1 contract|UnsupportedBackup)",
    "swa-reload-unmapped-rows": r"^StateLost: .*component swa\.",
    "swa-evict-off-by-one": r"^ReferenceMismatch: .*swa_evicted",
    "swa-evicted-seqlen-not-reset": r"^ReferenceMismatch: .*swa_evicted",
    "free-swa-keeps-mapping": r"(swa slot/page \d+ is held but also in the free list|DoubleFree)",
    "paged-free-partial-page": r"full slot/page \d+ is held but also in the free list",
    "pd-drops-mamba-fallback": r"^StateLost: .*transferred; component mamba\.",
    "cow-without-copy": r"^StateLost: .*component mamba\.",
    "stale-cow-source": r"^(StateLost: .*component mamba\.|ReferenceMismatch: mamba pool|InvariantViolation: mamba slot/page \d+ is held by two owners)",
    # The load-back lands in freed slots; the resumed request (or, where the old and new slots
    # coincide up to some position, its next decode) reads another position's rows.
    "reload-into-old-indices": r"^StateLost: .*(resumed|decoded); component ",
    "mamba-leak-on-abort": r"^ReferenceMismatch: mamba pool has \d+ free but the reference says",
    "allocator-double-free-undetected": r"(swa slot/page \d+ is held|swa free list holds duplicates|swa pool has)",
}

CELLS = [pytest.param(fid, name, id=f"{fid}@{name}") for fid in FAULTS for name in applicable_configs(fid)]


def test_every_fault_has_a_signature():
    """Adding a fault to the catalogue means saying what poolfuzz must report for it."""
    assert set(SIGNATURES) == set(FAULTS)


@pytest.mark.parametrize(("fault", "config"), CELLS)
def test_fault_is_found_and_named(fault, config):
    """The harness fails the faulty family, and its report points at the bug."""
    result = run_machine(CONFIGS[config], faults=[fault], max_examples=BUDGET, seed=0, shrink_limit=0)
    assert not result.passed, f"{fault} on {config} survived {result.examples} examples"
    assert re.search(SIGNATURES[fault], result.failure), result.failure
