"""Engine-level programs: the shrunk failure as plain engine calls, and their deterministic replay.

A program is a list of steps ``{"op": ..., "args": {...}, "outcome": ...}``. Replaying it runs
``getattr(engine, op)(**args)`` then ``engine.check()`` for each step on a fresh
:class:`~poolfuzz.harness.engine.Engine` (request ids are assigned deterministically), then the
machine's teardown checks, ``engine.sweep()`` and ``engine.drain()``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Iterator

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.forward import tree_verifies
from poolfuzz.harness.records import EngineOptions, Phase, StepRecord


def operations() -> dict[str, inspect.Signature]:
    """Every engine operation a program may call, with its signature."""
    return {name: inspect.signature(getattr(Engine, name)) for name in Engine.OPERATIONS}


def step_to_json(step: StepRecord) -> dict:
    return {"op": step.op, "args": _plain(step.args), "outcome": step.outcome}


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item"):  # a numpy / torch scalar
        return value.item()
    return str(value)


def check_steps(steps, where: str = "program") -> list[StepRecord]:
    """Steps from JSON, each naming a known operation with arguments it accepts; else ValueError."""
    if not isinstance(steps, list):
        raise ValueError(f"{where} must be a list of steps, got {type(steps).__name__}")
    ops = operations()
    out = []
    for i, raw in enumerate(steps, 1):
        if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
            raise ValueError(f"{where} step {i} is not an object with an 'op' name")
        op, args = raw["op"], raw.get("args", {})
        if op not in ops:
            raise ValueError(f"{where} step {i} names unknown operation {op!r} "
                             f"(known: {', '.join(sorted(ops))})")
        if not isinstance(args, dict):
            raise ValueError(f"{where} step {i} ({op}): 'args' must be an object")
        try:
            ops[op].bind(None, **args)
        except TypeError as exc:
            raise ValueError(f"{where} step {i} ({op}): arguments {args} do not fit {op}{ops[op]} ({exc})") from None
        out.append(StepRecord(op=op, args=dict(args), outcome=str(raw.get("outcome", ""))))
    return out


class CannotRun(Exception):
    """A step's precondition does not hold in this replay: the pools behaved differently earlier."""


def _need(engine: Engine, rid, phase: Phase, node: str | None = None) -> None:
    req = engine.requests.get(rid)
    if req is None:
        raise CannotRun(f"req {rid} does not exist (it was never admitted here, or has ended)")
    if req.phase is not phase:
        raise CannotRun(f"req {rid} is {req.phase.value}, the step needs it {phase.value}")
    if node is not None and req.node != node:
        raise CannotRun(f"req {rid} is on the {req.node} node, the step needs it on {node}")


def precondition(engine: Engine, step: StepRecord, *, strict: bool = False) -> None:
    """What the state machine guaranteed before it issued this step; CannotRun if it fails here.
    ``strict``: exactly what today's machine guarantees (an abort's request is retracted or mid-prefill), for
    programs made by editing; a recorded program is held to what any machine version issued."""
    a = step.args
    if step.op == "prefill":
        _need(engine, a["rid"], Phase.PREFILLING)
    elif step.op == "decode":
        for rid in a["rids"]:
            _need(engine, rid, Phase.RUNNING)
    elif step.op in ("retract", "finish", "decode_speculative"):
        _need(engine, a["rid"], Phase.RUNNING)
        if a.get("tree") and not tree_verifies(engine):  # recorded on a family whose pools move rows
            raise CannotRun("a tree verify needs a family whose pools move accepted rows "
                            "(supports_tree_drafts) and no speculative scratch; this one has not")
    elif step.op == "transfer":
        _need(engine, a["rid"], Phase.RUNNING, "prefill")
    elif step.op == "fork":
        _need(engine, a["src_rid"], Phase.RUNNING)
    elif step.op == "next_turn" and a["src_rid"] not in engine.finished:
        raise CannotRun(f"req {a['src_rid']} has not finished here (or has continued already)")
    elif step.op == "abort":
        req = engine.requests.get(a["rid"])
        mid_prefill = req is not None and req.phase is Phase.PREFILLING and req.kv.kv_committed_len > 0
        if strict and not mid_prefill:  # a retracted request, or one between two prefill chunks
            _need(engine, a["rid"], Phase.RETRACTED)
        elif a["rid"] not in engine.requests:
            raise CannotRun(f"req {a['rid']} does not exist (it was never admitted here, or has ended)")
    elif step.op == "resume" and a.get("node") not in engine.retracted:
        raise CannotRun(f"node {a.get('node')!r} does not exist")
    elif step.op == "flush":
        busy = [r.rid for r in engine.requests.values() if r.node == a["node"]]
        if busy or engine.caps[a["node"]].flush_cache is None:
            raise CannotRun(f"node {a['node']} cannot flush: " + (f"req {busy[0]} is live there" if busy
                            else "its family has no flush_cache"))


@dataclass(frozen=True)
class Event:
    """One replayed step (``index`` 1-based; ``teardown`` for the final sweep and drain)."""

    index: int
    step: StepRecord | None
    outcome: str  # what the step did in this replay
    occupancy: str
    failure: BaseException | None = None  # the divergence, if this step raised it
    cannot_run: str | None = None


def replay(engine: Engine, steps: list[StepRecord], *, strict: bool = False) -> Iterator[Event]:
    """Run ``steps`` on ``engine``; yields one event per step and one for the teardown checks.

    Stops after the first step that fails (its event carries the failure) or cannot run.
    ``strict``: hold every step to today's machine's preconditions (see ``precondition``).
    """
    for i, step in enumerate(steps, 1):
        try:
            precondition(engine, step, strict=strict)
        except CannotRun as exc:
            yield Event(i, step, "", engine.occupancy(), cannot_run=str(exc))
            return
        before = len(engine.log)
        try:
            getattr(engine, step.op)(**step.args)
            outcome = engine.log[-1].outcome if len(engine.log) > before else ""
            engine.check()
        except Exception as exc:  # the divergence (or a crash of the pools) reproduces here
            outcome = engine.log[-1].outcome if len(engine.log) > before else f"raised {type(exc).__name__}"
            yield Event(i, step, outcome, engine.occupancy(), failure=exc)
            return
        yield Event(i, step, outcome, engine.occupancy())
    start = len(engine.log)
    try:
        engine.sweep()  # marks the engine as tearing down: a failure here is signed "teardown"
        engine.drain()
    except Exception as exc:
        yield Event(len(steps) + 1, None, _teardown_outcome(engine, start), engine.occupancy(), failure=exc)
        return
    yield Event(len(steps) + 1, None, _teardown_outcome(engine, start), engine.occupancy())


def _teardown_outcome(engine: Engine, start: int) -> str:
    ended = [f"{r.op}({', '.join(f'{v}' for v in r.args.values())})" for r in engine.log[start:]]
    return "sweep, then drain: " + (", ".join(ended) if ended else "nothing live")


def new_engine(*, config, device="cpu", faults=(), backup_mode=None, options: dict | None = None,
               family_factory=None) -> Engine:
    """A fresh engine as the machine builds it; ``family_factory`` None is the built-in family."""
    opts = EngineOptions(**options) if options else EngineOptions()
    extra = {} if family_factory is None else {"family_factory": family_factory}
    return Engine(config=config, device=device, faults=tuple(faults), backup_mode=backup_mode, options=opts, **extra)
