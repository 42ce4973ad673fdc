"""Edits that shorten a failing program where deleting a step cannot: chunks, decodes and whole
requests folded into another request's prompt.

A failure that needs a pool nearly full is often left as several prefill chunks of one request, or
as decodes that only add tokens: Hypothesis shrinks numbers towards zero, so it never trades a step
for a longer prompt. Each edit here yields a program one step shorter that the machine could have
drawn (a prompt within the strategies' bound; a chunk of at most a whole prompt, as the warm start
prefills one); the minimiser keeps it only if the replay still fails with the same bug.
"""

from __future__ import annotations

from typing import Iterator

from poolfuzz.harness.records import StepRecord
from poolfuzz.strategies.ops import MAX_PROMPT

# The longest prefill chunk the machine runs: a whole prompt (its warm start prefills one at once).
MAX_CHUNK = MAX_PROMPT


def _with(step: StepRecord, **args) -> StepRecord:
    return StepRecord(op=step.op, args={**step.args, **args}, outcome=step.outcome)


def _grown(steps: list[StepRecord], admit: int, prefill: int, tokens: int) -> list[StepRecord] | None:
    """``steps`` with one request's admit (at ``admit``) and prefill chunk (at ``prefill``) longer by
    ``tokens``; None if its prompt would pass the machine's bound."""
    prompt = steps[admit].args["prompt_len"] + tokens
    if prompt > MAX_PROMPT:
        return None
    edited = list(steps)
    edited[admit] = _with(steps[admit], prompt_len=prompt)
    edited[prefill] = _with(steps[prefill], chunk=min(MAX_CHUNK, steps[prefill].args["chunk"] + tokens))
    return edited


def merged_prefills(steps: list[StepRecord]) -> Iterator[list[StepRecord]]:
    """Each prefill with the same request's next prefill folded into it (one chunk of their sum)."""
    for i, step in enumerate(steps):
        if step.op != "prefill":
            continue
        rid = step.args["rid"]
        j = next((k for k in range(i + 1, len(steps))
                  if steps[k].op == "prefill" and steps[k].args["rid"] == rid), None)
        if j is None:
            continue
        chunk = min(MAX_CHUNK, step.args["chunk"] + steps[j].args["chunk"])
        yield steps[:i] + [_with(step, chunk=chunk)] + steps[i + 1:j] + steps[j + 1:]


def decodes_into_prompts(steps: list[StepRecord], created: tuple) -> Iterator[list[StepRecord]]:
    """Each decode left out, the tokens it added given to its requests' prompts instead: each one's
    admit and its last prefill chunk before the decode grow by them (a chunk past the prompt's end
    is clipped by the prefill, so a chunk already long enough may stay at the bound)."""
    admitted = {rid: i for i, rid in enumerate(created) if rid is not None and steps[i].op == "admit"}
    for i, step in enumerate(steps):
        if step.op == "decode":
            rids, grows = step.args["rids"], (1,)
        elif step.op == "decode_speculative":
            rids, grows = [step.args["rid"]], tuple(dict.fromkeys((step.args["accepted"] + 1, 1)))
        else:
            continue
        places = []  # (admit index, last prefill index before the decode) of each decoded request
        for rid in rids:
            a = admitted.get(rid)
            p = next((k for k in range(i - 1, -1, -1) if steps[k].op == "prefill" and steps[k].args["rid"] == rid),
                     None)
            if a is None or p is None or a > i:
                break
            places.append((a, p))
        else:
            for n in grows:
                edited = steps
                for a, p in places:
                    edited = _grown(edited, a, p, n)
                    if edited is None:
                        break
                else:
                    yield edited[:i] + edited[i + 1:]


def decodes_into_other_prompts(steps: list[StepRecord], created: tuple) -> Iterator[list[StepRecord]]:
    """Each decode left out, the tokens it added given to another request's prompt: where the decoded
    request's prompt is already the longest the machine draws, a failure that needs the KV pool full
    still gets its tokens (one more request's admit and last prefill chunk before the decode grow)."""
    admitted = {rid: i for i, rid in enumerate(created) if rid is not None and steps[i].op == "admit"}
    for i, step in enumerate(steps):
        if step.op == "decode":
            decoded, tokens = set(step.args["rids"]), len(step.args["rids"])
        elif step.op == "decode_speculative":
            decoded, tokens = {step.args["rid"]}, step.args["accepted"] + 1
        else:
            continue
        for rid, a in admitted.items():
            p = next((k for k in range(i - 1, a, -1) if steps[k].op == "prefill" and steps[k].args["rid"] == rid),
                     None)
            edited = None if rid in decoded or p is None else _grown(steps, a, p, tokens)
            if edited is not None:
                yield edited[:i] + edited[i + 1:]


def requests_into_prompts(steps: list[StepRecord], created: tuple) -> Iterator[tuple[list[StepRecord], set[int]]]:
    """Each request that was only admitted and prefilled, left out, its prefilled tokens given to
    another request's prompt instead (that one's admit and last prefill chunk grow by them): a failure
    that needs the KV pool nearly full keeps the tokens and loses two steps. Yields (edited steps,
    indices to delete); the caller deletes them, renumbering the later requests."""
    admitted = {rid: i for i, rid in enumerate(created) if rid is not None and steps[i].op == "admit"}
    uses: dict[int, list[int]] = {rid: [] for rid in admitted}  # the steps after its admit naming it
    for i, step in enumerate(steps):
        for rid in [step.args[n] for n in ("rid", "src_rid") if n in step.args] + list(step.args.get("rids", ())):
            if rid in uses:
                uses[rid].append(i)
    for gone, a_gone in admitted.items():
        if not uses[gone] or any(steps[i].op != "prefill" for i in uses[gone]):
            continue
        tokens = sum(steps[i].args["chunk"] for i in uses[gone])
        for rid, a in admitted.items():
            prefills = [i for i in uses[rid] if steps[i].op == "prefill"]
            edited = None if rid == gone or not prefills else _grown(steps, a, prefills[-1], tokens)
            if edited is not None:
                yield edited, {a_gone, *uses[gone]}
