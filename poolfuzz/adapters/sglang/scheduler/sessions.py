"""The clients of a scheduler-path server's streaming sessions: turns sent, waited for, cancelled and closed.

A streaming session keeps its context (KV, request row, recurrent state) on the server between turns. Its client
sends a turn once the last one is answered, and closes the session when it is done; a client that gives up on a turn
(a timeout) aborts it, then closes. What the server does with each message is SGLang's own code: the Scheduler's
``open_session``, ``handle_generate_request`` (its session controller builds the turn's request from the session's
context) and ``close_session``; the messages are the release's own ``io_struct`` classes (dataclasses before
0.5.23, msgspec structs from it), built with the fields each release has.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang import compat
from poolfuzz.adapters.sglang.shims import cpu_server
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
        session's context. None while the last turn is in flight (the client waits for its answer); a turn the server
        answered at once, or whose session it would not open, is ``refused``."""
        d = self.driver
        if self.in_flight(sid):
            return None
        opened = sid in self.open or compat.session_opened(d.server.open_session(open_session_request(sid)))
        ids = list(range(d.fresh, d.fresh + length))
        d.fresh += length
        rid = f"{d.next_rid:06d}"
        d.next_rid += 1
        if not opened:  # the server refuses the id (it still holds a session of that id): the client sends nothing
            d.outcome[rid] = "refused"
            return rid
        self.open.setdefault(sid, [])
        params = d.m.SamplingParams(max_new_tokens=max_tokens)
        params.normalize(None)
        with cpu_server(d.environment):
            d.server.handle_generate_request(session_turn_request(rid=rid, ids=ids, sampling_params=params,
                                                                         session_id=sid))
        self.open[sid].append(rid)
        req = next((r for r in d.server.waiting_queue if r.rid == rid), None)
        if req is None:  # answered at once, never queued
            d.outcome[rid] = "refused"
            return rid
        d.runner.tokens[rid] = Tokens(ids=list(req.origin_input_ids))  # the session's context, then the new ids
        d.requests[rid] = req
        return rid

    def held_after_close(self) -> list[str]:
        """Sessions their clients closed, none of whose turns the server still has to answer, that the server has
        not released (``compat.closed_sessions_deferred``: its close waits for a turn it counts in flight)."""
        live = set(self.driver.requests)
        return [sid for sid in compat.closed_sessions_deferred(self.driver.server)
                if sid in self.closed and not live.intersection(self.closed[sid])]

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
        with cpu_server(self.driver.environment):
            self.driver.server.close_session(close_session_request(sid))
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


def _message(cls, values: dict):
    """One of the release's io_struct messages (a dataclass, or from 0.5.23 a msgspec struct) with ``values`` for the
    fields it has, and None for a required one not given (a field the scheduler path has nothing for)."""
    import dataclasses

    if dataclasses.is_dataclass(cls):
        fields = {f.name: f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                  for f in dataclasses.fields(cls) if f.init}
    else:  # msgspec (a keyword-only struct's defaulted fields may come before required ones: 0.5.15)
        import msgspec

        fields = {f.name: f.required for f in msgspec.structs.fields(cls)}
    kwargs = {name: values.get(name) for name, required in fields.items() if name in values or required}
    return cls(**kwargs)


def session_turn_request(*, rid: str, ids: list[int], sampling_params, session_id: str):
    """What the tokenizer manager sends the Scheduler for a turn of a streaming session: a tokenized generate
    request whose ``session_params`` name the session (``handle_generate_request`` builds the Req from it)."""
    from array import array

    from sglang.srt.managers.io_struct import SessionParams, TokenizedGenerateReqInput

    typed_array = "array" in str(getattr(TokenizedGenerateReqInput, "__annotations__", {}).get("input_ids", ""))
    return _message(TokenizedGenerateReqInput, dict(
        input_text="", input_ids=array("q", ids) if typed_array else list(ids), mm_inputs=None,
        sampling_params=sampling_params, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, stream=False, rid=rid, session_params=SessionParams(id=session_id)))


def open_session_request(session_id: str):
    """``OpenSessionReqInput`` of a streaming session (the server keeps its context between turns)."""
    from sglang.srt.managers.io_struct import OpenSessionReqInput

    return _message(OpenSessionReqInput, dict(capacity_of_str_len=1 << 20, session_id=session_id, streaming=True))


def close_session_request(session_id: str):
    from sglang.srt.managers.io_struct import CloseSessionReqInput

    return _message(CloseSessionReqInput, dict(session_id=session_id))
