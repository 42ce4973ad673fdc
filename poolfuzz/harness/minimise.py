"""Shorten a shrunk failing program further by deleting steps (renumbering the requests they made)
and by the edits of ``rewrites``.

Hypothesis shrinks a state machine's run by deleting and simplifying its choices; deleting the step
that admitted a request shifts the id of every later request, so a program often stays longer than
it needs to be (an admit whose request only mattered for its id). Here the engine-level program is
edited directly: a deleted step takes the steps that need its request with it, the later requests
are renumbered, and the shorter program is kept when a replay on a fresh engine still fails with the
same bug (``failures.bug_key`` of its signature). Every candidate runs the replay's own
preconditions, which are the state machine's, so a kept program is one the machine could have run.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

from poolfuzz.harness import failures, rewrites
from poolfuzz.harness.program import replay
from poolfuzz.harness.records import StepRecord

# Arguments that name a request by id (one or a list of them).
RID_ARGS = ("rid", "src_rid")
RID_LIST_ARGS = ("rids",)


@dataclass(frozen=True, kw_only=True)
class Replayed:
    """One replay of a candidate program: the failure it ended on, if any, and the ids it made."""

    failure: BaseException | None
    in_teardown: bool
    op: str
    created: tuple  # per step, the request id it created (admit, fork) or None
    cannot_run: bool
    outcomes: tuple = ()  # per step run, what it did in this replay (the ids renumbered)
    divergence: dict | None = None  # the failure's record (a crash's at the engine's step and action)

    def bug(self) -> str | None:
        if self.failure is None or self.cannot_run:
            return None
        return failures.bug_key(failures.signature_of(self.failure, in_teardown=self.in_teardown, op=self.op))


def run_program(new_engine: Callable, steps: list[StepRecord]) -> Replayed:
    """Replay ``steps`` on ``new_engine()``; a step the machine could not have issued is ``cannot_run``."""
    try:
        engine = new_engine()
    except Exception as exc:  # a failure while the families are built (an audit, a crash): step 0
        return Replayed(failure=exc, in_teardown=False, op="init", created=(), cannot_run=False,
                        divergence=failures.divergence_of(exc))
    with engine:  # a family's storage threads and files go with each replay
        return _replayed(engine, steps)


def _replayed(engine, steps: list[StepRecord]) -> Replayed:
    created: list = []
    outcomes: list = []
    last_rid = engine.next_rid
    for event in replay(engine, steps, strict=True):
        if event.step is not None:
            made = engine.next_rid != last_rid
            created.append(last_rid if made else None)
            last_rid = engine.next_rid
        if event.cannot_run is not None:
            return Replayed(failure=None, in_teardown=False, op="", created=tuple(created), cannot_run=True)
        if event.step is not None:
            outcomes.append(event.outcome)
        if event.failure is not None:
            return Replayed(failure=event.failure, in_teardown=event.step is None, op=engine.action,
                            created=tuple(created), cannot_run=False, outcomes=tuple(outcomes),
                            divergence=failures.divergence_of(event.failure, engine))
    return Replayed(failure=None, in_teardown=False, op="", created=tuple(created), cannot_run=False,
                    outcomes=tuple(outcomes))


def without(steps: list[StepRecord], created: tuple, drop: set[int]) -> list[StepRecord] | None:
    """``steps`` less the indices in ``drop`` and every step that needs a request they made, with
    the later requests renumbered as a fresh engine will number them; None if nothing is left."""
    drop = set(drop)
    gone: set = set()
    for i, step in enumerate(steps):
        if i in drop:
            if i < len(created) and created[i] is not None:
                gone.add(created[i])
            continue
        if any(step.args[n] in gone for n in RID_ARGS if n in step.args) or any(
                step.args[n] and all(r in gone for r in step.args[n]) for n in RID_LIST_ARGS if n in step.args):
            drop.add(i)  # (a batch loses only its requests that are gone; it goes once all are)
            if i < len(created) and created[i] is not None:
                gone.add(created[i])
    kept = [i for i in range(len(steps)) if i not in drop]
    if not kept:
        return None
    renumber: dict = {}
    for i in kept:
        if i < len(created) and created[i] is not None:
            renumber[created[i]] = len(renumber) + 1
    out = []
    for i in kept:
        step = steps[i]
        args = dict(step.args)
        for name in RID_ARGS:
            if name in args:
                args[name] = renumber.get(args[name], args[name])
        for name in RID_LIST_ARGS:
            if name in args:
                args[name] = [renumber.get(r, r) for r in args[name] if r not in gone]
        out.append(StepRecord(op=step.op, args=args, outcome=step.outcome))
    return out


def admits_for_pairs(steps: list[StepRecord], created: tuple):
    """Each two adjacent steps replaced by one bare admit (a one-token prompt, never prefilled), the
    requests after it renumbered: where a failure needs a freed slot handed out again, the steps
    that only moved the free list along (a retract and a resume) cost one allocation instead."""
    for i in range(len(steps) - 1):
        rest = without(steps, created, {i, i + 1})
        if rest is None:
            continue
        before = sum(1 for r in created[:i] if r is not None)  # steps before i are all kept
        shifted = []
        for step in rest[i:]:
            args = dict(step.args)
            for name in RID_ARGS:
                if name in args and args[name] > before:
                    args[name] += 1
            for name in RID_LIST_ARGS:
                if name in args:
                    args[name] = [r + 1 if r > before else r for r in args[name]]
            shifted.append(StepRecord(op=step.op, args=args, outcome=step.outcome))
        yield rest[:i] + [StepRecord(op="admit", args={"prompt_len": 1}, outcome="")] + shifted


def _requests_folded(steps: list[StepRecord], created: tuple):
    """``rewrites.requests_into_prompts`` with the folded request's steps deleted and the later
    requests renumbered."""
    for edited, drop in rewrites.requests_into_prompts(steps, created):
        candidate = without(edited, created, drop)
        if candidate is not None:
            yield candidate


def _fewer_decoded(steps: list[StepRecord]):
    """Each decode step with one of its requests left out (the batch's other requests stay)."""
    for i, step in enumerate(steps):
        rids = step.args.get("rids") if step.op == "decode" else None
        if rids and len(rids) > 1:
            for j in range(len(rids)):
                smaller = dict(step.args, rids=rids[:j] + rids[j + 1:])
                yield steps[:i] + [StepRecord(op=step.op, args=smaller, outcome=step.outcome)] + steps[i + 1:]


@dataclass(frozen=True, kw_only=True)
class Minimised:
    steps: list
    replayed: Replayed  # the replay of ``steps``: its failure is the one to report
    replays: int  # candidate programs tried
    seconds: float


def minimise(steps: list[StepRecord], *, new_engine: Callable, bug: str,
             max_seconds: float = 10.0, max_replays: int = 2000) -> Minimised | None:
    """The shortest program found by deleting steps (blocks, then single ones) that still fails as
    ``bug`` (a ``failures.bug_key``); None if ``steps`` does not reproduce it here at all."""
    started = time.perf_counter()
    replays = 0

    def attempt(candidate):
        nonlocal replays
        replays += 1
        got = run_program(new_engine, candidate)
        return got if got.bug() == bug else None

    current = list(steps)
    best = attempt(current)
    if best is None:
        return None

    def spent() -> bool:
        return replays >= max_replays or time.perf_counter() - started >= max_seconds

    improved = True
    while improved and not spent():
        improved = False
        block = max(1, len(current) // 2)
        while block >= 1 and not spent():
            i = 0
            while i < len(current) and not spent():
                candidate = without(current, best.created, set(range(i, min(i + block, len(current)))))
                got = attempt(candidate) if candidate is not None and len(candidate) < len(current) else None
                if got is not None:
                    current, best, improved = candidate, got, True
                else:
                    i += block
            block //= 2
        # Then the edits that keep every request but make a step redundant; after one succeeds,
        # deletion gets another go.
        edits = itertools.chain(_fewer_decoded(current), rewrites.merged_prefills(current),
                                rewrites.decodes_into_prompts(current, best.created),
                                rewrites.decodes_into_other_prompts(current, best.created),
                                _requests_folded(current, best.created), admits_for_pairs(current, best.created))
        for candidate in edits:
            if spent():
                break
            got = attempt(candidate)
            if got is not None:
                current, best, improved = candidate, got, True
                break
    # What each step did in the last replay: the recorded outcomes name the renumbered requests.
    current = [StepRecord(op=s.op, args=s.args, outcome=o) for s, o in zip(current, best.outcomes)] + current[
        len(best.outcomes):]
    return Minimised(steps=current, replayed=best, replays=replays, seconds=time.perf_counter() - started)
