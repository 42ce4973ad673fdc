"""Typed failures: each carries a structured divergence and a message that names whose data is where."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from poolfuzz.pools.speculative import draft_step


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
    check: str = ""  # the check that fired (see CHECKS); part of the failure's signature
    action: str = ""  # the last request-level action of the step (``op``, or a retract/resume it ran)
    space: str | None = None  # the index space it fired on (full, swa, mamba, rows, host.*)

    def to_json(self) -> dict:
        return asdict(self)

    def spaces(self) -> tuple[str, ...]:
        """Every index space the failure involves: its own, and for an outcome mismatch the space each
        side ran out of (``expected``/``found`` read "<space> exhausted" or "success")."""
        named = [self.space] if self.space else []
        if self.check == "outcome":
            named += [side.split(" ", 1)[0] for side in (self.expected, self.found)
                      if side and side.endswith(" exhausted")]
        return tuple(dict.fromkeys(named))


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
               found, verb, space, check="contents", action="") -> StateLost:
    d = Divergence(kind="state-lost", step=step, op=op, node=node, rid=rid, component=component, layer=layer,
                   position=position, slot_before=slot_before, slot_after=slot_after, expected=expected,
                   found=found, check=check, space=space, action=action or op)
    where = f"component {component} layer {layer}"
    if position is not None:
        where += f" position {position}"
    moved = ""
    if slot_before is not None and slot_before != slot_after:
        moved = f" (was slot {slot_before} before)"
    msg = (f"req {rid} {verb}; {where}; slot {slot_after}{moved} holds {found} "
           f"(expected {expected}) [step {step}, {op}, node {node}]")
    return StateLost(d, msg)


def invariant(*, step, op, detail, check, space=None, node="", kind="invariant", action="",
              slot=None, rid=None) -> InvariantViolation:
    return InvariantViolation(Divergence(kind=kind, step=step, op=op, node=node, rid=rid, detail=detail, check=check,
                                         space=space, action=action or op, slot_after=slot),
                              f"{detail} [step {step}, {op}{', node ' + node if node else ''}]")


def reference_mismatch(*, step, op, detail, check, space=None, node="", rid=None,
                       action="", slot=None, expected=None, found=None) -> ReferenceMismatch:
    return ReferenceMismatch(Divergence(kind="reference", step=step, op=op, node=node, rid=rid, detail=detail,
                                        check=check, space=space, action=action or op, slot_after=slot,
                                        expected=expected, found=found),
                             f"{detail} [step {step}, {op}{', node ' + node if node else ''}]")


# Every check the engine makes, by the name a signature, ``--waive`` and the reports use.
CHECKS: dict[str, str] = {
    "contents": "a live request's component holds the data its history says (per slot, by checksum)",
    "unmapped": "every position inside the SWA window has an SWA slot",
    "consumer-map": "what the kernels read to find a live request's state (the row-to-mamba-slot mapping, "
                    "full_to_swa of every held, unevicted token) points at the slots the request holds",
    "outcome": "the pools and the reference agree on success or on the space exhausted",
    "pool-error": "an operation the reference allows raises no pool error",
    "backup-short": "a retraction backup holds no fewer than seqlen-1 tokens (the last written one is kept)",
    "backup-long": "a retraction backup holds no more than seqlen-1 tokens (none without KV)",
    "lengths": "each request's allocated, committed, evicted and sequence lengths match the reference",
    "free-count": "each space's free count matches the reference (no leak, no double or lost free)",
    "live-requests": "the families and the reference know the same live requests",
    "reserved": "slot/page 0 (padding) is never in a free list and never handed out",
    "ownership": "every slot or page has one owner: a request or the free list (never two, never both)",
    "free-list": "a free list holds no unit twice and not the reserved one",
    "leak": "after every request ended, every space is whole",
    "stuck": "an engine's idle scheduler finishes every request it holds (none waits forever)",
    "row-bounds": "a request's allocated KV fits its request row (past it, a write lands on another row's positions)",
    "flush-leak": "after an idle node's cache flush reset its pools, every space is whole",
    "engine-idle-check": "on an idle node, the engine's own idle memory check (SGLang's Scheduler.on_idle) "
                         "reports nothing",
    "ssm-predicate": "uses_ssm_state agrees with the recurrent-state components the family has",
    "backup-mode": "a model with recurrent state never takes the host_pool retraction backup",
    "carries-mamba": "cpu_copy_carries_mamba says what the KV pool's CPU copy really carried",
    "backed-up-twice": "the recurrent state is backed up once",
    "shared-unit": "a unit of a pool its spaces share (vLLM's KV cache groups) sits in one space's tables, "
                   "and its ref count is its number of holders",
}
# Checks ``--waive`` may switch off: the structural ones, after which the engine stays consistent.
# The outcome checks are not: once the pools and the reference disagree, every later step would.
WAIVABLE = frozenset(CHECKS) - {"outcome", "pool-error", "backup-short", "backup-long"}
# Checks of a condition that persists once broken (a free list, a holding, a count): the operation
# that first sees it is incidental, so two signatures that differ only there name one bug.
STATE_CHECKS = frozenset({"reserved", "ownership", "free-list", "free-count", "leak", "flush-leak", "stuck",
                          "row-bounds",
                          "engine-idle-check",
                          "live-requests", "ssm-predicate", "backup-mode", "carries-mamba",
                          "backed-up-twice", "shared-unit",
                          "consumer-map"})


# failure class : check : space @ operation, e.g. StateLost:contents:mamba@resume, Crash:KeyError@decode
SIGNATURE = re.compile(r"^[A-Za-z]+(:[a-z-]+:[A-Za-z0-9_.*-]+(@[A-Za-z_.-]+)?|:[A-Za-z_][A-Za-z0-9_]*@[A-Za-z_.-]+"
                       r"|@[A-Za-z_.-]+)$")


def bug_key(signature: str) -> str:
    """What two signatures of one bug share: the whole signature, less the operation for a
    persistent-state check (see STATE_CHECKS), where one written by hand may carry it."""
    parts = signature.split(":")
    if len(parts) == 3 and parts[1] in STATE_CHECKS:
        return signature.rsplit("@", 1)[0]
    return signature


def signature_of(exc: BaseException, *, in_teardown: bool = False, op: str | None = None) -> str:
    """A short stable name of the bug, not of the example: the failure class, the check that fired,
    the space it fired on and the operation (``teardown`` for the final sweep and drain); no request
    ids, slots or seeds. A crash in the pools is ``Crash:<exception class>@op``."""
    if isinstance(exc, PoolfuzzFailure):
        return signature_from(exc.label, exc.divergence.to_json(), in_teardown=in_teardown)
    return signature_from(type(exc).__name__, {"kind": "exception", "op": op or "-"}, in_teardown=in_teardown)


def signature_from(error_type: str, divergence: dict, *, in_teardown: bool = False) -> str:
    """The signature of a recorded failure (an artifact's error type and divergence): the same
    string :func:`signature_of` gives the live failure. Artifacts recorded before signatures
    existed have no check name; their divergence kind stands in for it."""
    op = "teardown" if in_teardown else (divergence.get("action") or divergence.get("op") or "-")
    if divergence.get("kind") == "exception":
        return f"Crash:{error_type}@{op}"
    component = divergence.get("component")
    space = divergence.get("space") or (component.rsplit(".", 1)[0] if component else "-")
    if component and draft_step(component) is not None:
        space = "spec-scratch"  # every draft step of every state tensor of the scratch row: one kind of buffer
    elif component and _secondary_buffer(component, space):
        space = component  # one index space, several buffers (MLA, DSA, scales): each is its own bug
    check = divergence.get("check") or divergence.get("kind") or "-"
    if check in STATE_CHECKS:  # the operation that first sees a broken state is incidental
        return f"{error_type}:{check}:{space}"
    return f"{error_type}:{check}:{space}@{op}"


def _secondary_buffer(component: str, space: str) -> bool:
    """A buffer that shares its index space with others of another kind: an MLA part, a DSA index
    part, a block scale. Plain K and V, and recurrent state, are named by their space alone."""
    owner, _, part = component.rpartition(".")
    return owner.removeprefix("host.") != space.removeprefix("host.") or part.endswith("_scale")


def message_of(exc: BaseException) -> str:
    """The one-line report of a failure: a poolfuzz failure's own text, else ``Type: text``; an exception raised
    without a text (SGLang's bare ``NotImplementedError``, a bare ``assert``) says where it was raised instead."""
    if isinstance(exc, PoolfuzzFailure):
        return str(exc)
    return f"{type(exc).__name__}: {str(exc).strip() or raised_where(exc)}"


def raised_where(exc: BaseException) -> str:
    """``raised without a message in FILE:LINE FUNCTION, called from FILE:LINE FUNCTION``: the innermost two frames of
    ``exc``'s traceback, each file from its package on (``sglang/srt/...``); "raised without a message" alone if it has
    no traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-2:] if exc.__traceback__ is not None else []
    if not frames:
        return "raised without a message"

    def place(frame) -> str:
        path = frame.filename.replace("\\", "/")
        for anchor in ("/site-packages/", "/dist-packages/", "/poolfuzz/"):
            if anchor in path:
                path = ("poolfuzz/" if anchor == "/poolfuzz/" else "") + path.rsplit(anchor, 1)[1]
                break
        return f"{path}:{frame.lineno} {frame.name}"

    where = [place(frame) for frame in reversed(frames)]
    return "raised without a message in " + ", called from ".join(where)


def divergence_of(exc: BaseException, engine=None) -> dict:
    """A failure's divergence as JSON; a crash in the pools becomes an ``exception`` divergence at
    the engine's current step."""
    if isinstance(exc, PoolfuzzFailure):
        return exc.divergence.to_json()
    op = getattr(engine, "op", "")
    # The action names the crash, as it names a lost state: a retraction a decode ran is a retract.
    return {"kind": "exception", "step": getattr(engine, "step", 0), "op": op,
            "action": getattr(engine, "action", "") or op, "detail": message_of(exc), "check": "crash",
            "space": None}
