"""Speculative decoding's recurrent scratch: the state after each verified token, and the commit.

SGLang's ``MambaPool`` built with ``speculative_num_draft_tokens`` keeps, beside the conv and
temporal state, intermediate caches ``[mamba_layers, spec_state_size + 1, draft_tokens, *state]``:
the target-verify forward of a request writes the state it reaches after each of its draft tokens
into its scratch row, and once verification knows how many drafts were accepted the commit
(``update_mamba_state_after_mtp_verify``) copies the last accepted step's state into the request's
state slot, and into its track slot in extra-buffer mode. A rejected draft must leave no trace in
the state.

Here the scratch row of a request is its request row (SGLang's stable-rows layout,
``select_verify_intermediate_state_indices``): a request holds it exactly while it holds the row, so
the row's ownership, poisoning on free and the padding row 0 cover it. Each (state tensor, layer,
draft step) is one component in the ``rows`` space, named ``<state component>@draft<t>``; its rows
carry the tags of the state component they stand for, so a committed row is byte for byte the state.
"""

from __future__ import annotations

import torch

from poolfuzz.pools.components import Component

DRAFT_MARK = "@draft"


def scratch_name(state_component: str, step: int) -> str:
    return f"{state_component}{DRAFT_MARK}{step}"


def draft_step(name: str) -> int | None:
    """The draft step a scratch component holds (None: not a scratch component)."""
    base, mark, step = name.rpartition(DRAFT_MARK)
    return int(step) if mark and base else None


def state_component_of(name: str) -> str:
    """The state component whose rows a scratch component holds (the name itself for any other)."""
    return name.rpartition(DRAFT_MARK)[0] if draft_step(name) is not None else name


def scratch_components(state_tensors, scratch_tensors, layer_ids, draft_tokens: int) -> list[Component]:
    """Components of the scratch: ``scratch_tensors[i]`` is ``[layers, rows+1, draft_tokens, ...]`` beside
    the state tensor named ``state_tensors[i][0]``; one component per (state tensor, layer, step)."""
    return [Component(name=scratch_name(name, t), layer=layer_id, space="rows", tensor=buf[local][:, t])
            for (name, _), buf in zip(state_tensors, scratch_tensors)
            for local, layer_id in enumerate(layer_ids) for t in range(draft_tokens)]


class SpeculativeScratch:
    """The intermediate state caches of one MambaPool, one row per request row (row 0: padding)."""

    def __init__(self, *, rows: int, draft_tokens: int, mamba_pool):
        self.rows = rows
        self.draft_tokens = draft_tokens
        self.mamba_pool = mamba_pool
        self.buffers = [  # beside each state tensor, in mamba_pool.state_tensors() order
            torch.zeros((t.shape[0], rows + 1, draft_tokens, *t.shape[2:]), dtype=t.dtype, device=t.device)
            for _, t in mamba_pool.state_tensors()]

    def components(self) -> list[Component]:
        pool = self.mamba_pool
        return scratch_components(pool.state_tensors(), self.buffers, pool.layer_ids, self.draft_tokens)

    def commit(self, *, row: int, accepted_step: int, drafted_steps: int, state_slot: int,
               track_slot: int | None) -> None:
        """Verification accepted the tokens up to ``accepted_step`` (of ``drafted_steps`` written): that
        step's state becomes the request's, in its state slot and, in extra-buffer mode, its track slot."""
        for (_, state), buf in zip(self.mamba_pool.state_tensors(), self.buffers):
            for slot in (state_slot,) if track_slot is None else (state_slot, track_slot):
                state[:, slot] = buf[:, row, accepted_step]
