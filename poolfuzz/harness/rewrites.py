"""Edits that shorten a failing program where deleting a step cannot: chunks and decodes folded in.

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
                edited = list(steps)
                for a, p in places:
                    edited[a] = _with(edited[a], prompt_len=edited[a].args["prompt_len"] + n)
                    edited[p] = _with(edited[p], chunk=min(MAX_CHUNK, edited[p].args["chunk"] + n))
                if all(edited[a].args["prompt_len"] <= MAX_PROMPT for a, _ in places):
                    yield edited[:i] + edited[i + 1:]
