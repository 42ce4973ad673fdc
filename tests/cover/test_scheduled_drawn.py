"""Drawn configs on the scheduler machine (harness/scheduled.py): each example draws its config and starts its
server on it, a config the family declines rejects the example (told to the observer, never a failure), the drawn
config is what a failure records, and prompts are drawn in that config's units."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.scheduled import scheduled_machine
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from tests.cover.test_scheduled_sessions import RecordingDriver

SETTINGS = settings(max_examples=30, stateful_step_count=6, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class Observer:
    """What a run's tracker is told, kept."""

    def __init__(self):
        self.started = self.ended = 0
        self.declined: list[tuple[ModelConfig | None, str]] = []
        self.failed: list[ModelConfig] = []

    def example_started(self):
        self.started += 1

    def example_ended(self, machine):
        self.ended += 1

    def example_declined(self, config, reason):
        self.declined.append((config, reason))

    def step_ran(self, machine):
        pass

    def example_failed(self, machine, exc, steps, in_teardown):
        self.failed.append(machine.config)
        return False


class SizedDriver(RecordingDriver):
    """The recording server, keeping the config it was started on and the lengths it was handed."""

    def __init__(self, config):
        super().__init__(sessions=False)
        self.config, self.lengths = config, []

    def add_request(self, *, length, share, max_tokens, priority=0):
        self.lengths.append(length)
        return super().add_request(length=length, share=share, max_tokens=max_tokens, priority=priority)


def test_each_example_draws_its_config_and_starts_its_server_on_it():
    drivers: list[SizedDriver] = []
    observer = Observer()

    def factory(config):
        drivers.append(SizedDriver(config))
        return drivers[-1]

    run_state_machine_as_test(scheduled_machine("random", driver_factory=factory, observer=observer), settings=SETTINGS)
    configs = {d.config for d in drivers}
    assert len(configs) > 5 and all(isinstance(c, ModelConfig) for c in configs)
    assert any(c.has_mamba for c in configs) and any(c.page_size > 1 for c in configs)
    for d in drivers:  # prompts in the drawn config's units (thousands of tokens on a long-context draw)
        assert all(length % d.config.traffic_unit == 0 for length in d.lengths)
    assert any(d.config.traffic_unit > 1 and d.lengths for d in drivers)
    assert observer.started == observer.ended and not observer.failed


def test_a_config_the_family_declines_is_never_started_and_is_counted():
    """The family's reason filters the draws (no server is started on a declined config); where every draw of an
    example is declined, the observer hears the last reason, as the Engine machine's runs count them."""
    drivers: list[SizedDriver] = []
    observer = Observer()

    def factory(config):
        drivers.append(SizedDriver(config))
        return drivers[-1]

    def decline(config):
        return "no recurrent state on this server" if config.has_mamba else None

    machine = scheduled_machine("random", driver_factory=factory, observer=observer, decline=decline)
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert drivers and not any(d.config.has_mamba for d in drivers)
    assert observer.declined and {reason for _, reason in observer.declined} == {"no recurrent state on this server"}
    # at most one count an example, and none for an example whose server started on an accepted draw
    assert len(observer.declined) + len(drivers) <= observer.started


def test_a_config_the_server_refuses_at_startup_rejects_the_example():
    """A ConfigError from building the server on a drawn config (SGLang's refusal of a flag combination) is a decline:
    counted with its message, not a failure."""
    observer = Observer()

    def refuses(config):
        raise ConfigError(f"the server refuses {config.name!r}")

    with pytest.raises(Unsatisfiable):  # every example rejected
        run_state_machine_as_test(scheduled_machine("random", driver_factory=refuses, observer=observer),
                                  settings=SETTINGS)
    assert observer.declined and all(c is not None and "refuses" in why for c, why in observer.declined)
    assert not observer.failed


def test_a_server_that_crashes_at_startup_on_a_drawn_config_is_a_failure_recording_that_config():
    observer = Observer()

    def crashes(config):
        raise RuntimeError("startup crash")

    with pytest.raises(RuntimeError, match="startup crash"):
        run_state_machine_as_test(scheduled_machine("random", driver_factory=crashes, observer=observer),
                                  settings=SETTINGS)
    assert observer.failed and all(isinstance(c, ModelConfig) for c in observer.failed)


def test_a_name_that_is_neither_a_config_nor_random_is_refused():
    with pytest.raises(ConfigError, match="'dense'"):
        scheduled_machine("dense", driver_factory=SizedDriver)


def test_a_strategy_of_configs_is_drawn_from_and_filtered_by_the_family():
    """A test's own draw (here: only paged configs), and the family's declines on top (here: no mamba)."""
    from poolfuzz.strategies import drawn_configs

    drivers: list[SizedDriver] = []

    def factory(config):
        drivers.append(SizedDriver(config))
        return drivers[-1]

    machine = scheduled_machine(drawn_configs(where=lambda c: c.page_size > 1), driver_factory=factory,
                                decline=lambda c: "mamba" if c.has_mamba else None)
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert drivers and all(d.config.page_size > 1 and not d.config.has_mamba for d in drivers)
