"""Virtual-id mirrors of the unified memory pool's physical buffers, kept in step at each operation's edges.

SGLang's unified memory pool (``--enable-unified-memory``) hands out *virtual* slot ids: what the request
pool's ``req_to_token`` and mamba mapping hold. The data lives at *physical* rows of one shared byte buffer,
found through the sub-pool allocator's ``virtual_to_physical`` page table, and SGLang moves rows between
physical pages when it compacts (``MultiEndedAllocator._flush`` / ``_compact_pending``) and rebinds the table.

The harness reads and writes a component by the slot ids SGLang handed out. Each component is therefore a
mirror indexed by virtual id. At the start of every operation the rows of every held virtual id go to the
physical rows the table names now (``push``), as a forward's writes land where the kernel's translated
location points; after the operation they are read back from where the table then points (``pull``). A
move that drops or misplaces a row, a mapping that is not written (it resolves to the page-0 sink, where
every unmapped id collides), or two ids mapped to one page, all come back as another request's data in
the mirror, and the checksums name whose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, kw_only=True)
class Mirror:
    """One component: ``shadow[v]`` is virtual slot ``v``'s row; ``physical`` is SGLang's own view."""

    shadow: torch.Tensor
    physical: torch.Tensor
    translate: Callable[[torch.Tensor], torch.Tensor]  # virtual slot ids -> physical row ids (SGLang's)
    held: Callable[[], torch.Tensor]  # the virtual slot ids allocated now, and the padding slot 0

    def push(self) -> None:
        ids = self.held()
        self.physical[self.translate(ids)] = self.shadow[ids]

    def pull(self, ids: torch.Tensor | None = None) -> None:
        ids = self.held() if ids is None else ids
        self.shadow[ids] = self.physical[self.translate(ids)]


def held_slots(allocator) -> torch.Tensor:
    """Virtual token ids of a ``MultiEndedAllocator``'s pages not in its free list (the allocator's own
    id bookkeeping, not its mapping: an id handed out whose mapping was never written is still held),
    with page 0, the padding page every kernel writes past."""
    free = set(allocator.free_virtual_ids.tolist())
    pages = [0] + [p for p in range(allocator.min_page_index, allocator.num_virtual_ids) if p not in free]
    ps = allocator.pool_page_size
    base = torch.as_tensor(pages, dtype=torch.int64)
    return (base[:, None] * ps + torch.arange(ps)).reshape(-1)


def token_translate(allocator) -> Callable[[torch.Tensor], torch.Tensor]:
    """SGLang's own virtual -> physical token id translation of a ``MultiEndedAllocator``."""
    return lambda ids: allocator.translate_kv_loc(ids).to(torch.int64)


def shadow_like(physical: torch.Tensor, virtual_slots: int) -> torch.Tensor:
    """A zeroed virtual-id mirror of ``physical`` with ``virtual_slots`` rows."""
    return torch.zeros((virtual_slots, *physical.shape[1:]), dtype=physical.dtype, device=physical.device)
