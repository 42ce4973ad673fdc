"""The anchor: vLLM #44409, one physical block in two KV cache groups (fixed in 0.24.0).

A hybrid model (full attention + sliding window) serves a chat's next turn: the new request's
prompt starts with a finished request's prompt, so the scheduler finds a local prefix hit, and a
KV connector reports the tokens after it. Before #44409 the coordinator touched and extended one
group at a time, so the full group's allocation for the connector's tokens popped the SWA group's
hit block off the free queue before the SWA group touched it: both groups' layers then write the
same bytes. The harness's shared-unit audit names the block and both groups.

The test drives the scenario by hand: the family serves and finishes the first turn, then the test
calls vLLM's own manager as a scheduler with a connector would (``get_computed_blocks``, then
``allocate_slots`` with the connector's tokens), and the harness's audit checks the block tables.
No state machine finds it by itself any more: ``vllm:manager`` drives no connector (the scheduler's
connector rules are ``--family vllm``'s), and ``--family vllm`` runs a connector on a sliding-window
model only from 0.34 (``connector.hybrid_capable``), long after the fix.
"""

from __future__ import annotations

import pytest

from poolfuzz.harness.sharing import audit_shared_units
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.request import ReqKv

pytestmark = pytest.mark.anchored  # CI runs only these on 0.23.0, the last release before the fix

# Block size 2, a window of 4 (vLLM's 5), 11 usable blocks: small enough that the never-used blocks
# are gone and the finished request's blocks lead the free queue.
CONFIG = ModelConfig(name="vllm-44409", architecture="gemma3", page_size=2, full_layers=1, swa_layers=1,
                     sliding_window=4, full_tokens=22, swa_tokens=2, request_rows=4, max_context=22,
                     head_num=2, head_dim=8)


def _finished(fam, rid: int, tokens: int) -> ReqKv:
    req = ReqKv(rid=rid, seqlen=tokens)
    fam.protocol.admit(req, fam)
    fam.protocol.extend(req, fam, tokens)
    req.kv_committed_len = tokens
    return req


def _problems(fam) -> list[str]:
    held_by = {space: [] for space in fam.shared_unit_spaces if space in fam.free_lists()}
    for rid, live in fam.live.items():
        for space in held_by:
            held_by[space] += [(b, rid) for b in fam.block_ids(live, space) if b]
    found = []
    audit_shared_units(None, "prefill", fam, held_by, lambda check, detail, *a, **k: found.append(detail))
    return found


def test_next_turn_with_connector_tokens(api, expect):
    from poolfuzz.adapters.vllm import build_manager_family as build_family
    from poolfuzz.adapters.vllm.protocol import LiveRequest, token_id

    if not api.takes_external_tokens:
        pytest.skip(f"vllm {api.version}: allocate_slots takes no external (connector) tokens")
    fam = build_family(CONFIG)
    filler = _finished(fam, 9, 4)  # uses up the never-used blocks, freed after the first turn
    first = _finished(fam, 1, 6)
    fam.protocol.release_kv(first, fam)
    fam.protocol.release_kv(filler, fam)
    # The next turn: the first turn's 6 tokens, then 4 of its own.
    prompt = [token_id(1, p) for p in range(6)] + [token_id(2, p) for p in range(6, 10)]
    request = api.new_request("2", prompt, CONFIG.page_size)
    fam.live[2] = LiveRequest(rid=2, request=request, row=None)
    blocks, hit = fam.manager.get_computed_blocks(request)[:2]
    assert hit == 6, f"the next turn should hit the first turn's 3 blocks, hit {hit}"
    external = request.num_tokens - 1 - hit  # the connector holds the rest but the last token
    out = fam.manager.allocate_slots(request, request.num_tokens - hit - external, hit, blocks,
                                     num_external_computed_tokens=external)
    assert out is not None
    problems = _problems(fam)
    if expect == "44409":
        assert problems, f"vllm {api.version} is before #44409, but no block sits in two groups"
        assert "two KV cache groups: full (req 2) and swa (req 2)" in problems[0], problems[0]
        assert problems[0].startswith("block "), problems[0]
    else:
        assert problems == [], problems
