"""The engine's records: request phases and views, engine options, and executed steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from poolfuzz.pools.request import ReqKv

NODES = ("prefill", "decode")
NO_CULPRIT = 0xFFFF  # the culprit tag of a poisoned row freed outside any request's operation


class Phase(enum.Enum):
    PREFILLING = "prefilling"
    RUNNING = "running"
    RETRACTED = "retracted"


@dataclass(kw_only=True)
class Request:
    """The engine's view of one request; ``kv`` is what the pools see."""

    rid: int
    node: str
    prompt_len: int
    kv: ReqKv
    phase: Phase
    verb: str = "admitted"  # what last happened to it, for messages
    origin: str = "admitted"  # how it came to be: admitted, forked (a prefix hit) or transferred (PD)
    expected: dict = field(default_factory=dict)  # component key -> expected checksums by position
    slots_before: dict | None = None  # physical slots at the last retract / transfer, by space

    def __repr__(self) -> str:
        return f"Req({self.rid})"

    @property
    def outputs(self) -> int:
        return self.kv.seqlen - self.prompt_len if self.phase is not Phase.PREFILLING else 0


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """``sweep_interval``: every N steps check every live slot, not just the touched ones.
    ``resume_after_decode``: after a decode step, try to resume the node's first retracted request,
    as SGLang's decode loop does every iteration (so resumes also happen under pool pressure).
    ``retract_on_decode_oom``: a decode that finds no KV slot retracts SGLang's victim and tries
    again, as ``retract_decode`` does, so retractions (and the resumes after them) happen exactly
    when the pools are short.
    ``waive``: checks (names from ``failures.CHECKS``) that count their violations instead of
    failing, so a known bug that fires early in every example does not hide the rest.
    ``known``: signatures of bugs found before. A violation of a waivable check with a known
    signature is passed over (counted), and so is every later violation of the same check on the
    same space in that example (the condition persists); a known failure of any other check ends
    the example, which the machine then rejects."""

    sweep_interval: int = 8
    poison: bool = True
    resume_after_decode: bool = True
    retract_on_decode_oom: bool = True
    waive: tuple[str, ...] = ()
    known: tuple[str, ...] = ()

    # What a program recorded before an option existed ran with: replaying an old artifact must
    # play its steps as they were recorded, not under behaviour added since.
    RECORDED_BEFORE: ClassVar[dict[str, object]] = {"retract_on_decode_oom": False}


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One executed operation, with the requests it resolved to: the replayable program."""

    op: str
    args: dict
    outcome: str

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.op}({args})  # {self.outcome}"
