"""A page of a storage tier below the host (HiCache's L3), as a family reads it back for the checks."""

from __future__ import annotations

from dataclasses import dataclass

from poolfuzz.pools.components import Component


@dataclass(frozen=True, kw_only=True)
class StoredPage:
    """One stored page: the key it is stored under, the token positions that key covers (each with the
    request whose token it is: who wrote that position's KV) and its rows, one component per buffer and
    layer, ``tensor[i]`` the row of position ``first_position + i``. A page whose rows are not the KV of
    its key's positions was stored under the wrong key, or written wrong."""

    key: str
    first_position: int
    owners: tuple[int, ...]  # per row of the page, the request whose token it is
    components: tuple[Component, ...]

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + len(self.owners))
