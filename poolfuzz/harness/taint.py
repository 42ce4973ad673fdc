"""Where a known bug passed over in an example reached: the slots, spaces and requests it makes suspect."""

from __future__ import annotations

from poolfuzz.pools.errors import PoolError


class KnownBugTaint:
    """The engine's bookkeeping of known bugs passed over (``taint`` and ``tainted_requests``, set up by
    the engine): a later failure there is downstream of the known bug, not a new one."""

    def taint_with(self, divergence) -> None:
        """A known bug was passed over here: what it touched is suspect for the rest of the example."""
        space = divergence.space or "*"
        self.taint.add((space, divergence.slot_after if space != "*" else None))
        if divergence.check == "shared-unit":  # one block of the pool every group draws from: the
            # same block in each group, and every group's free count, are suspect from here on
            caps = self.caps.get(divergence.node)
            self.taint.update((s, divergence.slot_after) for s in (caps.shared_unit_spaces if caps else ()))
        if divergence.rid is not None:
            self.tainted_requests.add(divergence.rid)

    def tainted(self, divergence) -> bool:
        """Is a failure downstream of a known bug passed over earlier in this example? Where it names
        a slot, only that slot of its space counts; else any taint of its space (or of anything)."""
        if not self.taint:
            return False
        if ("*", None) in self.taint or divergence is None or not divergence.space:
            return True
        if divergence.rid is not None and divergence.rid in self.tainted_requests:
            return True
        slot = divergence.slot_after
        # An outcome mismatch involves the space each side ran out of: a known leak of mamba slots
        # explains "reference predicts full exhausted, pools gave mamba exhausted".
        for space in divergence.spaces():
            if (space, None) in self.taint:
                return True
            # A pool's own error (a double free) surfaces where broken bookkeeping is next used, not
            # at the slot a check saw broken: any known bug in its space explains it.
            if slot is not None and divergence.check != "pool-error":
                if (space, slot) in self.taint:
                    return True
            elif any(s == space for s, _ in self.taint):
                return True
        return False

    def crash_downstream(self, exc: BaseException | None = None) -> bool:
        """Does a crash of the pools follow from a known bug passed over earlier in this example? When
        the pools' own typed error names a space a known bug broke (a double free of a slot whose
        mapping a known bug left behind), or when the operation that crashed served a request the known
        bug reached: a crash elsewhere (a release that cannot retract at all, an index out of bounds on
        a fresh admit) is a bug of its own, however broken something else already was."""
        if ("*", None) in self.taint:
            return True
        space = getattr(exc, "space", None) if isinstance(exc, PoolError) else None
        if space is not None and any(s == space for s, _ in self.taint):
            return True
        args = self.pending[1] if self.pending else {}
        rids = [args[k] for k in ("rid", "src_rid") if k in args] + list(args.get("rids", ()))
        return any(r in self.tainted_requests for r in rids)
