"""Prompts drawn in units (harness/scheduled.py): on a config whose context is more than 64 tokens the scheduler
machine hands the driver ``max_context // 64`` tokens per drawn unit, records what it drew, and a replay of the
recorded program hands the driver the same token counts again."""

from __future__ import annotations

from poolfuzz.harness.scheduled import replay, scheduled_machine
from poolfuzz.pools.config import CONFIGS
from tests.cover.test_scheduled_sessions import RecordingDriver


class LengthDriver(RecordingDriver):
    """The recording server, keeping each request's and turn's length as the driver is handed it."""

    def __init__(self):
        super().__init__(sessions=True)
        self.lengths: list[int] = []

    def add_request(self, *, length, share, max_tokens, priority=0):
        self.lengths.append(length)
        return super().add_request(length=length, share=share, max_tokens=max_tokens, priority=priority)

    def session_turn(self, *, session, length, max_tokens):
        self.lengths.append(length)
        return super().session_turn(session=session, length=length, max_tokens=max_tokens)


def _run(config_name: str):
    drivers: list[LengthDriver] = []

    def factory(config):
        drivers.append(LengthDriver())
        return drivers[-1]

    machine = scheduled_machine(CONFIGS[config_name], driver_factory=factory)()
    machine.add_request(length=3, share=0, max_tokens=2)
    machine.session_turn(session=1, length=5, max_tokens=1)
    return machine, drivers


def test_a_long_context_config_draws_prompts_in_units_and_replays_them_unchanged():
    machine, drivers = _run("dsa-ps64")  # 256-token context: units of 4 tokens
    assert CONFIGS["dsa-ps64"].max_context // 64 == 4
    assert drivers[0].lengths == [12, 20]
    assert [s.args["length"] for s in machine.program] == [3, 5]  # what was drawn, so a replay scales it once
    assert [s.outcome for s in machine.program] == ["req 000001 (12 new tokens)", "req 000002 (20 new tokens)"]
    steps = list(replay(type(machine), machine.program))
    assert all(r.failure is None and r.cannot_run is None for r in steps), steps
    assert drivers[-1].lengths == [12, 20]


def test_a_short_context_config_draws_tokens():
    machine, drivers = _run("dense")
    assert drivers[0].lengths == [3, 5]
    assert [s.outcome for s in machine.program] == ["req 000001", "req 000002"]
