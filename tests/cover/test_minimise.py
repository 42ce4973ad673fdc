"""The last pass over a reported program: steps Hypothesis could not delete (an admit whose request
only mattered for its id) go, the later requests are renumbered, and the same bug still shows."""

import pytest

from poolfuzz.harness.failures import bug_key, signature_of
from poolfuzz.harness import rewrites
from poolfuzz.harness.minimise import admits_for_pairs, minimise, run_program, without
from poolfuzz.harness.program import new_engine
from poolfuzz.harness.records import StepRecord
from poolfuzz.pools.config import CONFIGS
from tests.cover.programs import FAULT_35957, PROGRAM_35957


def _steps(raw):
    return [StepRecord(op=s["op"], args=dict(s["args"]), outcome="") for s in raw]


def _engine():
    return new_engine(config=CONFIGS["swa-ssm"], faults=[FAULT_35957])


# #35957 behind a bystander: Req(1) is admitted and served first, so the story's request is Req(2).
PADDED = _steps([{"op": "admit", "args": {"prompt_len": 3}}, {"op": "prefill", "args": {"rid": 1, "chunk": 3}},
                 {"op": "admit", "args": {"prompt_len": 1}}, {"op": "prefill", "args": {"rid": 2, "chunk": 1}},
                 {"op": "decode", "args": {"rids": [1, 2]}}, {"op": "retract", "args": {"rid": 2}},
                 {"op": "resume", "args": {"node": "prefill"}}])


def test_deleting_an_admit_renumbers_the_later_requests_and_takes_its_steps_with_it():
    created = (1, None, 2, None, None, None, None)
    shorter = without(PADDED, created, {0})
    assert [(s.op, s.args) for s in shorter] == [
        ("admit", {"prompt_len": 1}), ("prefill", {"rid": 1, "chunk": 1}), ("decode", {"rids": [1]}),
        ("retract", {"rid": 1}), ("resume", {"node": "prefill"})]


def test_a_step_that_needs_a_deleted_request_goes_too():
    created = (1, None, 2, None, None, None, None)
    shorter = without(PADDED, created, {2})  # Req(2)'s admit: its prefill and retract go, the batch shrinks
    assert [(s.op, s.args) for s in shorter] == [
        ("admit", {"prompt_len": 3}), ("prefill", {"rid": 1, "chunk": 3}), ("decode", {"rids": [1]}),
        ("resume", {"node": "prefill"})]
    assert without(PADDED[:1], (1,), {0}) is None


def test_the_padded_story_minimises_to_the_four_steps_of_35957_with_the_same_bug():
    original = run_program(_engine, PADDED)
    assert original.created[:3] == (1, None, 2) and original.failure is not None
    bug = original.bug()
    assert bug == "StateLost:contents:mamba@resume"
    got = minimise(PADDED, new_engine=_engine, bug=bug)
    assert got is not None and got.replays > 1
    assert [(s.op, s.args) for s in got.steps] == [(s.op, s.args) for s in _steps(PROGRAM_35957)]
    assert bug_key(signature_of(got.replayed.failure, op=got.replayed.op)) == bug
    assert got.replayed.failure.divergence.rid == 1  # the report names the renumbered request


def test_a_program_that_does_not_show_the_bug_is_not_minimised():
    assert minimise(PADDED[:4], new_engine=_engine, bug="StateLost:contents:mamba@resume") is None


def test_an_edited_program_is_held_to_the_machines_own_preconditions():
    """The machine aborts retracted requests only: an edit that aborts a running one cannot run."""
    edited = _steps([{"op": "admit", "args": {"prompt_len": 1}}, {"op": "prefill", "args": {"rid": 1, "chunk": 1}},
                     {"op": "abort", "args": {"rid": 1}}])
    assert run_program(_engine, edited).cannot_run


def test_the_minimised_program_says_what_each_step_did_in_its_own_replay():
    bug = run_program(_engine, PADDED).bug()
    got = minimise(PADDED, new_engine=_engine, bug=bug)
    assert got.steps[0].outcome.startswith("Req(1) ")  # not the padded program's "Req(2) ..."
    assert all(s.outcome for s in got.steps)


def test_prefill_chunks_of_one_request_fold_into_one():
    steps = _steps([{"op": "admit", "args": {"prompt_len": 9}}, {"op": "prefill", "args": {"rid": 1, "chunk": 4}},
                    {"op": "admit", "args": {"prompt_len": 2}}, {"op": "prefill", "args": {"rid": 1, "chunk": 5}}])
    assert [[(s.op, s.args) for s in c] for c in rewrites.merged_prefills(steps)] == [[
        ("admit", {"prompt_len": 9}), ("prefill", {"rid": 1, "chunk": 9}), ("admit", {"prompt_len": 2})]]


def test_a_decode_folds_into_the_prompts_of_every_request_it_decoded():
    steps = _steps([{"op": "admit", "args": {"prompt_len": 5}}, {"op": "prefill", "args": {"rid": 1, "chunk": 5}},
                    {"op": "admit", "args": {"prompt_len": 20}}, {"op": "prefill", "args": {"rid": 2, "chunk": 20}},
                    {"op": "decode", "args": {"rids": [1]}}, {"op": "decode", "args": {"rids": [1, 2]}},
                    {"op": "decode_speculative", "args": {"rid": 1, "draft": 3, "accepted": 2}}])
    created = (1, None, 2, None, None, None, None)
    got = [[(s.op, s.args) for s in c] for c in rewrites.decodes_into_prompts(steps, created)]
    head = [("admit", {"prompt_len": 20}), ("prefill", {"rid": 2, "chunk": 20})]
    assert got == [
        [("admit", {"prompt_len": 6}), ("prefill", {"rid": 1, "chunk": 6}), *head,
         ("decode", {"rids": [1, 2]}), ("decode_speculative", {"rid": 1, "draft": 3, "accepted": 2})],
        # (decode [1, 2] cannot fold: Req(2)'s prompt is already the longest the machine draws)
        *[[("admit", {"prompt_len": 5 + n}), ("prefill", {"rid": 1, "chunk": 5 + n}), *head,
           ("decode", {"rids": [1]}), ("decode", {"rids": [1, 2]})] for n in (3, 1)],
    ]


def test_a_leak_left_in_chunks_minimises_to_the_shortest_known_program():
    from poolfuzz.pools.shortest_known import SHORTEST_KNOWN
    from tests.cover.programs import FAULT_LEAK_ON_ABORT, PROGRAM_LEAK_ON_ABORT_CHUNKED

    def engine():
        return new_engine(config=CONFIGS["hybrid-linear"], faults=[FAULT_LEAK_ON_ABORT])

    steps = _steps(PROGRAM_LEAK_ON_ABORT_CHUNKED)
    bug = run_program(engine, steps).bug()
    assert bug == "ReferenceMismatch:free-count:mamba"
    got = minimise(steps, new_engine=engine, bug=bug)  # only the two prefills of Req(3) can merge
    assert len(got.steps) == SHORTEST_KNOWN[FAULT_LEAK_ON_ABORT] == len(steps) - 1
    assert ("prefill", {"rid": 3, "chunk": 20}) in [(s.op, s.args) for s in got.steps]


def test_two_steps_become_one_admit_with_the_later_requests_renumbered():
    created = (1, None, 2, None, None, None, None)
    got = [[(s.op, s.args) for s in c] for c in admits_for_pairs(PADDED, created)]
    assert got[0] == [("admit", {"prompt_len": 1}), ("admit", {"prompt_len": 1}),
                      ("prefill", {"rid": 2, "chunk": 1}), ("decode", {"rids": [2]}), ("retract", {"rid": 2}),
                      ("resume", {"node": "prefill"})]  # Req(1) and its prefill gone: the batch keeps Req(2)
    # Req(2)'s prefill and the decode become a new Req(3); the earlier Req(2) keeps its id
    assert got[3][2:5] == [("admit", {"prompt_len": 1}), ("admit", {"prompt_len": 1}), ("retract", {"rid": 2})]


def test_a_free_list_moved_along_by_retracts_costs_one_admit_per_slot():
    from tests.cover.programs import FAULT_NOT_CLEARED, PROGRAM_NOT_CLEARED_CYCLED

    def engine():
        return new_engine(config=CONFIGS["hybrid-linear"], faults=[FAULT_NOT_CLEARED])

    steps = _steps(PROGRAM_NOT_CLEARED_CYCLED)
    bug = run_program(engine, steps).bug()
    assert bug == "StateLost:contents:mamba@prefill"
    got = minimise(steps, new_engine=engine, bug=bug)
    assert len(got.steps) == 8 and [s.op for s in got.steps].count("resume") <= 1


def test_a_request_only_admitted_and_prefilled_folds_into_another_requests_prompt():
    steps = _steps([{"op": "admit", "args": {"prompt_len": 3}}, {"op": "prefill", "args": {"rid": 1, "chunk": 3}},
                    {"op": "admit", "args": {"prompt_len": 16}}, {"op": "prefill", "args": {"rid": 2, "chunk": 10}},
                    {"op": "prefill", "args": {"rid": 2, "chunk": 6}}, {"op": "retract", "args": {"rid": 2}}])
    created = (1, None, 2, None, None, None)
    got = [([(s.op, s.args) for s in edited], drop) for edited, drop in rewrites.requests_into_prompts(steps, created)]
    # Req(1) into Req(2): its admit and last chunk grow by Req(1)'s 3 tokens, Req(1)'s steps go
    assert got[0] == ([("admit", {"prompt_len": 3}), ("prefill", {"rid": 1, "chunk": 3}),
                       ("admit", {"prompt_len": 19}), ("prefill", {"rid": 2, "chunk": 10}),
                       ("prefill", {"rid": 2, "chunk": 9}), ("retract", {"rid": 2})], {0, 1})
    assert len(got) == 1  # Req(2) has a step other than prefill (the retract): it is not folded away


def test_a_decode_of_a_request_at_the_longest_prompt_folds_into_another_requests_prompt():
    steps = _steps([{"op": "admit", "args": {"prompt_len": 20}}, {"op": "prefill", "args": {"rid": 1, "chunk": 20}},
                    {"op": "admit", "args": {"prompt_len": 4}}, {"op": "prefill", "args": {"rid": 2, "chunk": 4}},
                    {"op": "decode_speculative", "args": {"rid": 1, "draft": 3, "accepted": 2}}])
    created = (1, None, 2, None, None)
    got = [[(s.op, s.args) for s in c] for c in rewrites.decodes_into_other_prompts(steps, created)]
    assert got == [[("admit", {"prompt_len": 20}), ("prefill", {"rid": 1, "chunk": 20}),
                    ("admit", {"prompt_len": 7}), ("prefill", {"rid": 2, "chunk": 7})]]  # 2 accepted + 1
    assert not list(rewrites.decodes_into_prompts(steps, created))  # Req(1) has no room for them


@pytest.mark.parametrize("program", ["PROGRAM_LEAK_EXTRA_REQUEST", "PROGRAM_LEAK_DECODED_AT_BOUND"])
def test_a_leak_left_long_by_a_hunt_minimises_to_within_two_of_the_shortest(program):
    from poolfuzz.pools.shortest_known import SHORTEST_KNOWN
    from tests.cover import programs

    def engine():
        return new_engine(config=CONFIGS["hybrid-linear"], faults=[programs.FAULT_LEAK_ON_ABORT])

    steps = _steps(getattr(programs, program))
    bug = run_program(engine, steps).bug()
    assert bug == "ReferenceMismatch:free-count:mamba"
    got = minimise(steps, new_engine=engine, bug=bug, max_seconds=120)
    assert len(got.steps) <= SHORTEST_KNOWN[programs.FAULT_LEAK_ON_ABORT] + 1 < len(steps) - 1
