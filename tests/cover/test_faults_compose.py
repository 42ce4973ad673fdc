"""Catalogue faults compose: faults that override different methods are switched on together, and
each one's bug is still there; faults that change the same method are refused, naming it."""

import pytest

from poolfuzz.errors import ConfigError
from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.faults import FAULTS, blueprint_with
from poolfuzz.pools.protocol import ServingProtocol


def test_two_protocol_faults_compose_into_one_class():
    bp = blueprint_with(["swa-ignores-mamba-backup", "mamba-leak-on-abort"], CONFIGS["swa-ssm"])
    names = {klass.__name__ for klass in bp.protocol.__mro__}
    assert {"CallerSkipsMambaBackup", "ResumeLeaksMambaOnAbort", "ServingProtocol"} <= names
    proto = bp.protocol()
    # Each fault's override is the one that runs for the method it changes.
    assert type(proto).mamba_pool_needing_backup is FAULTS["swa-ignores-mamba-backup"].overrides["protocol"].mamba_pool_needing_backup
    assert type(proto).pre_alloc is FAULTS["mamba-leak-on-abort"].overrides["protocol"].pre_alloc
    assert type(proto).admit is ServingProtocol.admit


@pytest.mark.parametrize(("pair", "method"), [
    (["cow-without-copy", "stale-cow-source"], "ServingProtocol.run_deferred_mamba_ops"),
    (["free-swa-keeps-mapping", "allocator-double-free-undetected"], "SWATokenAllocator.free_swa"),
])
def test_faults_changing_the_same_method_are_refused(pair, method):
    config = CONFIGS["swa-ssm"]
    with pytest.raises(ConfigError, match=f"both change {method}"):
        blueprint_with(pair, config)


def test_every_pair_either_composes_or_names_its_clash():
    """Over the whole catalogue: no pair crashes with anything but a ConfigError."""
    config = CONFIGS["swa-ssm-ps4"]
    fits = [f for f in FAULTS if FAULTS[f].applies_to(config)]
    composed = 0
    for i, a in enumerate(fits):
        for b in fits[i + 1:]:
            try:
                blueprint_with([a, b], config)
                composed += 1
            except ConfigError as exc:
                assert "both change" in str(exc) or "backup paths" in str(exc) or "different backup" in str(exc), exc
    assert composed > 50


def test_a_run_with_two_protocol_faults_finds_a_bug():
    result = run_machine(CONFIGS["swa-ssm"], faults=["swa-ignores-mamba-backup", "mamba-leak-on-abort"],
                         max_examples=100, seed=0, shrink_limit=0)
    assert not result.passed and result.faults == ("swa-ignores-mamba-backup", "mamba-leak-on-abort")
