"""The storage tier below the host (HiCache's L3), checked page by page as a family reads it back.

A family that keeps pages in a storage tier has ``take_stored_pages()``: each page stored since the
last call (``pools.storage_tier.StoredPage``), with the positions its key covers and who wrote them.
Every row of every component must then be the KV of that position, written by that request: a page
stored under another page's key, a page written with a layer missing or a row torn is named here, when
it is stored, before any request reads it back.
"""

from __future__ import annotations

from poolfuzz.harness import failures
from poolfuzz.harness.checksums import row_checksums
from poolfuzz.harness.contents import describe_row
from poolfuzz.harness.ledger import ComponentSpec


def audit_storage(engine, fail) -> None:
    """Check every page each family stored since the last check (families without a storage tier: none)."""
    for node in engine.families:
        take = engine.caps[node].take_stored_pages
        if take is None:
            continue
        for page in take():
            _check_page(engine, node, page, fail)


def _check_page(engine, node: str, page, fail) -> None:
    first, n = page.first_position, len(page.owners)
    owners = [0] * first + list(page.owners)  # kv_for_owners reads owners by absolute position
    for comp in page.components:
        spec = ComponentSpec.of(comp)
        expected = engine.ledger.kv_for_owners(spec, owners, first, first + n)
        got = row_checksums(comp.tensor.cpu().contiguous())
        engine.stats["checksum_calls"] += 1
        wrong = (got != expected).nonzero().flatten().tolist()
        if not wrong:
            continue
        i = wrong[0]
        position, owner = first + i, page.owners[i]
        fail(failures.state_lost(
            step=engine.step, op=engine.op, node=node, rid=owner, component=comp.name, layer=comp.layer,
            position=position, slot_before=None, slot_after=i, expected=f"req {owner} pos {position}",
            found=describe_row(comp.tensor[i].cpu()), verb=f"stored in L3 (page key {page.key[:12]}, row {i} of "
            f"positions {first}-{first + n - 1})", space=comp.space, check="storage", action=engine.action))
