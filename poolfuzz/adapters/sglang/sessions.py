"""The clients of a scheduler-path server's streaming sessions: turns sent, waited for, cancelled and closed.

A streaming session keeps its context (KV, request row, recurrent state) on the server between turns. Its client
sends a turn once the last one is answered, and closes the session when it is done; a client that gives up on a turn
(a timeout) aborts it, then closes. What the server does with each message is SGLang's own code: the Scheduler's
``open_session``, ``handle_generate_request`` (its session controller builds the turn's request from the session's
context) and ``close_session``.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang import compat
from poolfuzz.adapters.sglang.shims import cpu_pin_memory
from poolfuzz.pools.token_chain import Tokens


class SessionClients:
    """The clients of one driver's server (``scheduling.SglangSchedulerDriver``), one per session id."""

    def __init__(self, driver):
        self.driver = driver
        self.open: dict[str, list[str]] = {}  # open session -> its turns' request ids
        self.closed: dict[str, list[str]] = {}  # closed session -> its turns' request ids

    def in_flight(self, sid: str) -> bool:
        turns = self.open.get(sid)
        return bool(turns) and turns[-1] in self.driver.requests

    def turn(self, sid: str, *, length: int, max_tokens: int) -> str | None:
        """The next turn of session ``sid`` (opened first where it is not open): ``length`` fresh tokens after the
        session's context. None while the last turn is in flight (the client waits for its answer)."""
        d = self.driver
        if self.in_flight(sid):
            return None
        if sid not in self.open:
            d.server.open_session(compat.open_session_request(sid))
            self.open[sid] = []
        ids = list(range(d.fresh, d.fresh + length))
        d.fresh += length
        rid = f"{d.next_rid:06d}"
        d.next_rid += 1
        params = d.m.SamplingParams(max_new_tokens=max_tokens)
        params.normalize(None)
        with cpu_pin_memory():
            d.server.handle_generate_request(compat.session_turn_request(rid=rid, ids=ids, sampling_params=params,
                                                                         session_id=sid))
        self.open[sid].append(rid)
        req = next((r for r in d.server.waiting_queue if r.rid == rid), None)
        if req is None:  # answered at once, never queued
            d.outcome[rid] = "refused"
            return rid
        d.runner.tokens[rid] = Tokens(ids=list(req.origin_input_ids))  # the session's context, then the new ids
        d.requests[rid] = req
        return rid

    def close(self, sid: str, *, give_up: bool) -> None:
        """Close ``sid`` once its last turn is answered; with ``give_up``, the client first cancels the turn it waits
        for (aborts it), then closes once the server has answered the abort."""
        if sid not in self.open:
            return
        if self.in_flight(sid):
            if not give_up:
                return
            self.driver.abort(self.open[sid][-1])
            if self.in_flight(sid):  # the abort is answered at the next step
                return
        with cpu_pin_memory():
            self.driver.server.close_session(compat.close_session_request(sid))
        self.closed[sid] = self.open.pop(sid)

    def close_all(self, *, give_up: bool) -> None:
        for sid in sorted(self.open):
            self.close(sid, give_up=give_up)

    def told(self) -> str:
        """The sessions of this example and what became of each turn (appended to a leak's report)."""
        parts = []
        for sid, rids in [*self.closed.items(), *self.open.items()]:
            turns = ", ".join(f"req {rid} {self.driver.outcome.get(rid, 'in flight')}" for rid in rids)
            parts.append(f"{sid} ({'closed' if sid in self.closed else 'open'}; turns: {turns or 'none'})")
        return "; streaming sessions: " + "; ".join(parts) if parts else ""
