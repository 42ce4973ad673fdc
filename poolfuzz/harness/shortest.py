"""The shortest program that fails: every program of a small vocabulary, by increasing length.

The shrinker stops where Hypothesis's passes stop; this search says how short a failure can be at all.
It backs the catalogue's ``SHORTEST_KNOWN`` column and answers "is this shrunk program minimal?".
Programs are replayed from a fresh engine at every node (engines cannot be copied: their pools own
tensors and listeners), so the cost grows as the vocabulary's branching to the power of the length:
lengths up to about 6 take seconds to minutes on the named configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from poolfuzz.errors import ConfigError, reraise_api_change
from poolfuzz.harness.failures import message_of, signature_of
from poolfuzz.harness.forward import tree_verifies
from poolfuzz.harness.program import CannotRun, precondition
from poolfuzz.harness.records import NODES, Phase, StepRecord


@dataclass(frozen=True, kw_only=True)
class Shortest:
    """The first failing program of the shortest length that has one (in the vocabulary's order)."""

    steps: tuple[StepRecord, ...]
    failure: str  # the exception as the engine raised it
    signature: str
    in_teardown: bool  # the steps ran; the final sweep and drain failed
    explored: int  # programs run to find it (all shorter ones included)


def prompt_lengths(config) -> tuple[int, ...]:
    """Prompts that reach each boundary the pools care about: one token, a page, a page and one, the
    window and one (SWA); plus a long prompt of 16."""
    ps = config.page_size
    lengths = {1, ps, ps + 1, 16}
    if config.has_swa:
        lengths.add(config.sliding_window + 1)
    return tuple(sorted(n for n in lengths if n <= config.max_context))


def vocabulary(engine, prompts: tuple[int, ...]) -> list[StepRecord]:
    """Every next step the state machine could issue here, one argument choice per boundary."""
    caps = engine.caps["prefill"]

    def can(op: str) -> bool:
        return getattr(caps, f"supports_{op}")  # a Capabilities field

    def step(op, **args):
        return StepRecord(op=op, args=args, outcome="")

    out = [step("admit", prompt_len=p) for p in prompts]
    running = [r.rid for r in engine.live(Phase.RUNNING)]
    for req in engine.live(Phase.PREFILLING):
        left = req.prompt_len - req.kv.kv_committed_len
        out += [step("prefill", rid=req.rid, chunk=c) for c in sorted({1, left}) if 0 < c <= left]
        if req.kv.kv_committed_len > 0:
            out.append(step("abort", rid=req.rid))
    for rid in running:
        out += [step("decode", rids=[rid]), step("retract", rid=rid), step("finish", rid=rid)]
        if can("speculative"):
            out += [step("decode_speculative", rid=rid, draft=2, accepted=a) for a in (0, 2)]
        if tree_verifies(engine):  # two drafts a level, two levels accepted: the path moves
            out.append(step("decode_speculative", rid=rid, draft=4, accepted=2, tree=True))
        if can("fork"):
            out.append(step("fork", src_rid=rid, extra=1))
        if can("transfer") and engine.requests[rid].node == "prefill":
            out.append(step("transfer", rid=rid))
    if len(running) > 1:
        out.append(step("decode", rids=running))
    for req in engine.live(Phase.RETRACTED):
        out.append(step("abort", rid=req.rid))
    out += [step("resume", node=n) for n in NODES if engine.retracted.get(n)]
    out += [step("next_turn", src_rid=rid, extra=1) for rid in sorted(engine.finished)]
    out += [step("flush", node=n) for n in engine.flushable()]
    return out


def shortest_failure(new_engine: Callable[[], object], *, max_steps: int, prompts: tuple[int, ...],
                     on_length: Callable[[int, int], None] | None = None) -> tuple[Shortest | None, int]:
    """Search programs of length 0, 1, ... ``max_steps``; the first that fails, and how many ran.
    ``new_engine()`` builds a fresh engine (with the faults under study); ``on_length(length, explored)``
    reports progress after each length that found nothing."""
    explored = 0

    def run(steps: list[StepRecord]):
        """(engine, failure) after ``steps``; failure None if they ran clean."""
        engine = new_engine()
        for s in steps:
            try:
                precondition(engine, s, strict=True)
            except CannotRun:
                engine.close()
                raise
            try:
                getattr(engine, s.op)(**s.args)
                engine.check()
            except Exception as exc:  # noqa: BLE001 - a failure of the pools is what is searched for
                reraise_api_change(exc)
                return engine, exc
        return engine, None

    def teardown(engine):
        try:
            engine.sweep()
            engine.drain()
        except Exception as exc:  # noqa: BLE001
            reraise_api_change(exc)
            return exc
        return None

    def found(steps, engine, exc, in_teardown):
        return Shortest(steps=tuple(steps), failure=message_of(exc), explored=explored,
                        signature=signature_of(exc, in_teardown=in_teardown, op=engine.action),
                        in_teardown=in_teardown)

    def search(prefix: list[StepRecord], length: int) -> Shortest | None:
        nonlocal explored
        engine, _ = run(prefix)
        with engine:  # every engine built is closed: a family's storage threads and files go with it
            if len(prefix) == length:
                explored += 1
                exc = teardown(engine)
                return None if exc is None else found(prefix, engine, exc, True)
            moves = vocabulary(engine, prompts)
        for nxt in moves:
            steps = prefix + [nxt]
            try:
                child, exc = run(steps)
            except CannotRun:
                continue
            with child:
                if exc is not None:  # a failure at a step: the program ends here
                    explored += 1
                    if len(steps) == length:
                        return found(steps, child, exc, False)
                    continue  # shorter than this length: searched (and passed over) at its own length
            result = search(steps, length)
            if result is not None:
                return result
        return None

    try:
        new_engine().close()
    except ConfigError:
        raise  # an impossible config or fault selection is the user's to fix, not a failure found
    except Exception as exc:  # noqa: BLE001 - the families' own audits fail as they are built
        reraise_api_change(exc)
        return Shortest(steps=(), failure=message_of(exc), explored=1, in_teardown=False,
                        signature=signature_of(exc, op="init")), 1
    for length in range(max_steps + 1):
        result = search([], length)
        if result is not None:
            return result, explored
        if on_length is not None:
            on_length(length, explored)
    return None, explored
