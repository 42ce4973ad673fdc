"""A chat's next turn: a new request whose prompt continues a finished request's tokens.

A family that declares ``supports_next_turn`` keeps a finished request's tokens; the engine keeps
what their KV should be (the committed positions, whose owner wrote each, the recurrent state's
history). The next turn's prompt is those tokens and ``extra`` of its own: the engine's prefix
cache may find the finished request's blocks (now in its free queue, cached), and a KV connector
may report the tokens after the hit (as on a PD decode node, which receives the whole prompt but
its last token). Each finished request continues once: two live turns of one conversation would
share blocks, which the reference's counting (one block per held position range) does not model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolfuzz.harness.records import Phase, Request
from poolfuzz.pools.request import ReqKv


@dataclass(frozen=True, kw_only=True)
class FinishedTurn:
    """What a finished request left for its next turn: its committed tokens and their contents."""

    rid: int
    node: str
    tokens: int  # positions whose KV was written (the prefix cache may hold their full blocks)
    expected: dict  # component key -> expected checksums of positions [0, tokens)
    kv_owner: tuple[int, ...]  # per position, the request whose token it is
    state: tuple | None  # the recurrent state's history (segments), None without one


def can_continue(engine) -> bool:
    """The family keeps finished requests' tokens (``supports_next_turn``; False unless declared)."""
    return engine.caps["prefill"].supports_next_turn


def remember(engine, req: Request) -> None:
    """Before ``finish`` releases ``req``: what its next turn starts from (families that continue only)."""
    if not can_continue(engine):
        return
    ref = engine.refs[req.node].request(req.rid)
    tokens = req.kv.kv_committed_len
    engine.finished[req.rid] = FinishedTurn(
        rid=req.rid, node=req.node, tokens=tokens,
        expected={key: vec[:tokens].clone() for key, vec in req.expected.items()},
        kv_owner=tuple(ref.kv_owner[:tokens]), state=ref.state)


def next_turn(engine, src_rid: int, extra: int) -> int | None:
    """Admit the next turn of finished request ``src_rid``: its tokens, then ``extra`` new ones.

    The family looks its prompt up (the prefix hit and the connector's tokens are the engine's
    choice, told to the reference), then schedules every token up to the last, as vLLM schedules
    a request whose KV is loaded: positions after the hit are written by the load (or recomputed),
    and the last prompt token is left to the next prefill."""
    engine._begin("next_turn", {"src_rid": src_rid, "extra": extra})
    src = engine.finished[src_rid]
    node = src.node
    fam, ref = engine.families[node], engine.refs[node]
    rid = engine.next_rid
    seqlen = src.tokens + extra
    if engine.longer_than_context(seqlen):
        return None
    kv = ReqKv(rid=rid, seqlen=seqlen)
    found = fam.protocol.begin_turn(kv, fam, src_rid=src_rid, prefix=src.tokens)
    loaded = seqlen - 1
    owners = src.kv_owner + (rid,) * (loaded - src.tokens)
    state = None
    if src.state is not None:
        state = src.state + (((rid, src.tokens, loaded),) if loaded > src.tokens else ())
    err = engine._both(node, rid,
                       lambda: ref.next_turn(rid, seqlen=seqlen, kv_owner=owners, state=state, **found),
                       lambda: fam.protocol.resume(kv, fam))
    if err:
        fam.protocol.end_turn(kv, fam)
        engine._record(f"{err.space} exhausted")
        return None
    engine.next_rid += 1
    del engine.finished[src_rid]  # a conversation continues once
    req = Request(rid=rid, node=node, prompt_len=seqlen, kv=kv, phase=Phase.PREFILLING,
                  verb="continued", origin="continued")
    for key, vec in src.expected.items():  # the loaded positions after the prefix hold its own tokens
        req.expected[key] = torch.cat([vec, engine.ledger.kv(engine.specs[key], rid, src.tokens, loaded)])
    engine.requests[rid] = req
    if kv.recompute_from is not None:  # what the hit did not cover is loaded (or recomputed) now
        engine.writer.recompute(req, kv.recompute_from, ref.request(rid))
        kv.recompute_from = None
    if src_rid in engine.tainted_requests:
        engine.tainted_requests.add(rid)
    engine.touched.add(rid)
    engine._record(f"Req({rid}) prefix {src.tokens} hit {found.get('hit', 0)} "
                   f"external {found.get('external', 0)}")
    return rid
