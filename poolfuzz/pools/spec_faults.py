"""Catalogue faults of speculative decoding's recurrent scratch: the commit after verify reads the wrong state."""

from __future__ import annotations

from poolfuzz.pools.speculative import SpeculativeScratch


class CommitsLastDraft(SpeculativeScratch):
    """The commit after verify copies the state after the last *drafted* token instead of the last
    accepted one (accept length taken for the last correct step): the rejected drafts stay folded into
    the recurrent state, and the request decodes on from a state of tokens it never kept."""

    def commit(self, *, row, accepted_step, drafted_steps, state_slot, track_slot):
        super().commit(row=row, accepted_step=drafted_steps - 1, drafted_steps=drafted_steps,
                       state_slot=state_slot, track_slot=track_slot)


class CommitsByBatchPosition(SpeculativeScratch):
    """The verify wrote the scratch by request row (the stable-rows layout) but the commit reads it by
    the request's position in the verify batch (the default ``arange`` rows, ``src_indices_raw`` left
    None): a batch of one commits scratch row 0, the padding row, into the request's state."""

    def commit(self, *, row, accepted_step, drafted_steps, state_slot, track_slot):
        super().commit(row=0, accepted_step=accepted_step, drafted_steps=drafted_steps,
                       state_slot=state_slot, track_slot=track_slot)
