"""Typed failures: each carries a structured divergence and a message that names whose data is where."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """One observed difference between the real family and what it should hold."""

    kind: str  # "state-lost", "invariant", "reference", "capability", "predicate"
    step: int
    op: str  # the operation of that step, e.g. "resume"
    node: str = ""
    rid: int | None = None
    component: str | None = None
    layer: int | None = None
    position: int | None = None
    slot_before: int | None = None
    slot_after: int | None = None
    expected: str | None = None
    found: str | None = None
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


class PoolfuzzFailure(AssertionError):
    """Base of every harness failure; ``divergence`` is the structured record."""

    label = "Failure"

    def __init__(self, divergence: Divergence, message: str):
        self.divergence = divergence
        super().__init__(f"{self.label}: {message}")


class StateLost(PoolfuzzFailure):
    """A live request's component does not hold the data it should."""

    label = "StateLost"


class InvariantViolation(PoolfuzzFailure):
    """A pool broke a structural law: conservation, double holding, slot 0, mapping, capability."""

    label = "InvariantViolation"


class ReferenceMismatch(PoolfuzzFailure):
    """The real family and the reference model disagree on an outcome or a length."""

    label = "ReferenceMismatch"


def state_lost(*, step, op, node, rid, component, layer, position, slot_before, slot_after, expected,
               found, verb) -> StateLost:
    d = Divergence(kind="state-lost", step=step, op=op, node=node, rid=rid, component=component, layer=layer,
                   position=position, slot_before=slot_before, slot_after=slot_after, expected=expected,
                   found=found)
    where = f"component {component} layer {layer}"
    if position is not None:
        where += f" position {position}"
    moved = ""
    if slot_before is not None and slot_before != slot_after:
        moved = f" (was slot {slot_before} before)"
    msg = (f"req {rid} {verb}; {where}; slot {slot_after}{moved} holds {found} "
           f"(expected {expected}) [step {step}, {op}, node {node}]")
    return StateLost(d, msg)


def invariant(*, step, op, detail, node="", kind="invariant") -> InvariantViolation:
    return InvariantViolation(Divergence(kind=kind, step=step, op=op, node=node, detail=detail),
                              f"{detail} [step {step}, {op}{', node ' + node if node else ''}]")


def reference_mismatch(*, step, op, detail, node="", rid=None) -> ReferenceMismatch:
    return ReferenceMismatch(Divergence(kind="reference", step=step, op=op, node=node, rid=rid, detail=detail),
                             f"{detail} [step {step}, {op}{', node ' + node if node else ''}]")


def message_of(exc: BaseException) -> str:
    """The one-line report of a failure: a poolfuzz failure's own text, else ``Type: text``."""
    return str(exc) if isinstance(exc, PoolfuzzFailure) else f"{type(exc).__name__}: {exc}"


def divergence_of(exc: BaseException, engine=None) -> dict:
    """A failure's divergence as JSON; a crash in the pools becomes an ``exception`` divergence at
    the engine's current step."""
    if isinstance(exc, PoolfuzzFailure):
        return exc.divergence.to_json()
    return {"kind": "exception", "step": getattr(engine, "step", 0), "op": getattr(engine, "op", ""),
            "detail": message_of(exc)}
