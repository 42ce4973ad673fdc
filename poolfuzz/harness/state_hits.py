"""Recurrent states a prefix lookup found: a cached state must be the state after exactly its prefix.

A family whose prefix cache keeps recurrent states per block (vLLM's mamba cache mode "align")
says, through its protocol's optional ``cached_states(kv, family)``, which state units a resume or
a next turn starts from: ``(unit, tokens, loaded)``. A unit the local prefix cache hit (``loaded``
False) must hold the state after the request's first ``tokens`` tokens, as the forward that ended
there wrote it; a state cached under the wrong prefix, or a block reused while cached, is caught
here, before the recompute overwrites the running state. A unit a KV connector filled (``loaded``
True) is written with that state: the connector's load, which the worker would run.
"""

from __future__ import annotations

import torch

from poolfuzz.harness import failures, row_cache
from poolfuzz.harness.contents import describe_row


def history_until(history: tuple, tokens: int) -> tuple:
    """The state's history cut after its first ``tokens`` tokens (segments are ``(rid, start, end)``)."""
    out = []
    for rid, start, end in history:
        if start >= tokens:
            break
        out.append((rid, start, min(end, tokens)))
    return tuple(out)


def settle_cached_states(engine, req, ref, state_plan) -> None:
    """Check the states the lookup hit and write the ones the connector loaded (see the module)."""
    fam = engine.families[req.node]
    found = engine.caps[req.node].cached_states
    if found is None or not state_plan or not ref.state:
        return
    for unit, tokens, loaded in found(req.kv, fam):
        history = history_until(ref.state, tokens)
        rid, _, end = history[-1]
        chain = engine.ledger.chain(history)
        for comp, spec in state_plan:
            row = row_cache.state_row(spec, rid, end, chain)
            if loaded:
                comp.tensor[unit] = row
            elif not torch.equal(comp.tensor[unit].cpu(), row):
                raise failures.state_lost(
                    step=engine.step, op=engine.op, node=req.node, rid=req.rid, component=comp.name,
                    layer=comp.layer, position=tokens - 1, slot_before=None, slot_after=unit,
                    expected=f"the state after {tokens} tokens ({engine.ledger.describe_state(history)})",
                    found=describe_row(comp.tensor[unit].cpu()), verb=f"hit a cached state after {tokens} tokens",
                    space="mamba", check="state-hit")
