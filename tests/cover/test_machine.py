"""The state machine passes on every correct family, in every backup mode the config allows."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.machine import machine_for
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import resolved_backup_mode

CASES = [
    pytest.param(name, mode, id=f"{name}-{mode}")
    for name, config in CONFIGS.items()
    for mode in ("cpu_tensor", "host_pool")
    if mode == "cpu_tensor" or resolved_backup_mode(config) == "host_pool"  # where a host pool can hold it
]


@pytest.mark.parametrize(("config", "backup_mode"), CASES)
def test_correct_family_survives_the_machine(config, backup_mode, device):
    """Every live request keeps every component through admit, decode, retract, resume, transfer, fork."""
    machine = machine_for(config, device=device, backup_mode=backup_mode)
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=40))
