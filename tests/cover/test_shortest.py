"""``poolfuzz shortest``: every short program, by length, finds the shortest failure and no shorter."""

import io

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.cli.shortest import main as shortest_main
from poolfuzz.harness.program import new_engine
from poolfuzz.harness.shortest import prompt_lengths, shortest_failure
from poolfuzz.pools.config import CONFIGS


def _search(config, faults, max_steps):
    return shortest_failure(lambda: new_engine(config=CONFIGS[config], faults=faults), max_steps=max_steps,
                            prompts=prompt_lengths(CONFIGS[config]))


def test_reload_into_old_indices_is_four_steps_on_page_size_one():
    """Served, retracted, resumed: the resume reads its new slots while the load wrote the old ones."""
    result, explored = _search("dense", ["reload-into-old-indices"], 4)
    assert [s.op for s in result.steps] == ["admit", "prefill", "retract", "resume"]
    assert result.signature == "StateLost:contents:full@resume" and not result.in_teardown
    assert result.failure.startswith("StateLost: req 1 resumed") and explored == result.explored > 4


def test_nothing_fails_without_a_fault_and_the_search_says_so():
    result, explored = _search("dense", [], 2)
    assert result is None and explored > 3  # every program of 0, 1 and 2 steps ran


def test_a_fault_seen_by_the_sweep_of_no_steps_is_zero_steps():
    result, _ = _search("hybrid-linear", ["mamba-slot-zero"], 2)
    assert result.steps == () and result.signature == "InvariantViolation:reserved:mamba"


def test_prompts_reach_each_boundary_of_the_config():
    assert prompt_lengths(CONFIGS["dense-ps4"]) == (1, 4, 5, 16)
    swa = CONFIGS["swa-ssm"]
    assert swa.sliding_window + 1 in prompt_lengths(swa)


class _Args:
    def __init__(self, **kw):
        self.__dict__.update({"faults": [], "max_steps": 5, "backup_mode": None, **kw})


def test_the_command_prints_the_program_and_exits_1():
    out = io.StringIO()
    assert shortest_main(_Args(config="dense", faults=["reload-into-old-indices"], max_steps=4), out) == 1
    text = out.getvalue()
    assert "no failing program of 3 steps" in text and "shortest: 4 steps, fails at step 4" in text
    assert "  3  retract(rid=1)" in text and "  4  resume(node=prefill)" in text


@pytest.mark.parametrize("argv, problem", [
    (["--config", "dense", "--max-steps", "13"], "--max-steps 13: give 0 to 12"),
    (["--config", "dense", "--faults", "swa-ignores-mamba-backup"], "does not apply to config 'dense'"),
    (["--config", "gpt-9"], "unknown config 'gpt-9'"),
])
def test_bad_usage_is_one_line_and_exit_2(argv, problem, capsys):
    assert run_cli(["shortest", *argv]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err


def _fails(config, faults, program):
    engine = new_engine(config=CONFIGS[config], faults=faults)
    try:
        for op, args in program:
            getattr(engine, op)(**args)
            engine.check()
        engine.sweep()
        engine.drain()
    except Exception as exc:  # noqa: BLE001 - whichever failure the fault causes
        return exc
    return None


RELOAD_PAGED = [("admit", {"prompt_len": 1}), ("admit", {"prompt_len": 1}), ("prefill", {"rid": 1, "chunk": 1}),
                ("retract", {"rid": 1}), ("prefill", {"rid": 2, "chunk": 1}), ("decode", {"rids": [2]})]
NOT_CLEARED_EXTRA_BUFFER = [("admit", {"prompt_len": 1}), ("prefill", {"rid": 1, "chunk": 1}),
                            ("fork", {"src_rid": 1, "extra": 1}), ("admit", {"prompt_len": 1}),
                            ("finish", {"rid": 1}), ("admit", {"prompt_len": 1}), ("prefill", {"rid": 4, "chunk": 1})]


@pytest.mark.parametrize(("fault", "config", "program"), [
    ("reload-into-old-indices", "dense-ps4", RELOAD_PAGED),
    ("mamba-not-cleared", "hybrid-extra-buffer", NOT_CLEARED_EXTRA_BUFFER),
])
def test_a_shape_that_needs_a_longer_program_has_one_of_that_length(fault, config, program):
    from poolfuzz.pools.shortest_known import SHORTEST_KNOWN, shortest_known

    assert len(program) == shortest_known(fault, CONFIGS[config]) > SHORTEST_KNOWN[fault] == shortest_known(fault)
    assert isinstance(_fails(config, [fault], program), AssertionError)  # a poolfuzz failure, not a crash
    assert _fails(config, [], program) is None


@pytest.mark.slow
def test_on_pages_the_resume_gets_its_own_pages_back_so_four_steps_do_not_show_the_reload_bug():
    result, explored = _search("dense-ps4", ["reload-into-old-indices"], 4)
    assert result is None and explored > 1000
