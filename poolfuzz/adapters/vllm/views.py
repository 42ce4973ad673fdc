"""The vLLM block pool and block tables in the terms the harness reads (free lists, token slots)."""

from __future__ import annotations

import torch


class RowFreeList:
    """The worker's input-batch rows: one per scheduled request, handed out lowest first."""

    def __init__(self, size: int):
        self.size = size
        self._free = list(range(1, size + 1))  # row 0 stays reserved, as the harness expects of rows
        self.on_free = None

    def take(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def give_back(self, row: int) -> None:
        self._free.append(row)
        self._free.sort()
        if self.on_free is not None:
            self.on_free("rows", torch.tensor([row], dtype=torch.int64))

    def available_size(self) -> int:
        return len(self._free)

    def is_free_page(self, unit: int) -> bool:
        return unit in self._free

    def free_pages(self) -> list[int]:
        return list(self._free)

    def free_list_problem(self) -> str | None:
        return "a row is listed twice" if len(set(self._free)) != len(self._free) else None


class BlockSpace:
    """One KV cache group's view of vLLM's shared BlockPool: every group draws from the same blocks.

    Units are block ids; ``available_size`` is vLLM's own free-block count, in the group's units
    (token slots for attention groups). ``ref_count`` and ``describe_unit`` serve the harness's
    audit of blocks held twice."""

    def __init__(self, *, space: str, block_pool, scale: int, pool_problem):
        self.space = space
        self.block_pool = block_pool
        self.scale = scale
        self._pool_problem = pool_problem  # () -> what is wrong with the shared pool as a whole, or None
        self.on_free = None

    def __repr__(self) -> str:
        return f"BlockSpace({self.space})"

    def available_size(self) -> int:
        return int(self.block_pool.get_num_free_blocks()) * self.scale

    def is_free_page(self, unit: int) -> bool:
        block = self.block_pool.blocks[unit]
        return block.ref_cnt == 0 and not block.is_null

    def free_pages(self) -> list[int]:
        return [b.block_id for b in self.block_pool.free_block_queue.get_all_free_blocks()]

    def ref_count(self, unit: int) -> int:
        return int(self.block_pool.blocks[unit].ref_cnt)

    def describe_unit(self, unit: int) -> str:
        block = self.block_pool.blocks[unit]
        cached = "cached" if block.block_hash is not None else "uncached"
        return f"block {unit} (ref_cnt {block.ref_cnt}, {cached})"

    def free_list_problem(self) -> str | None:
        free = self.free_pages()
        if len(set(free)) != len(free):
            dup = next(u for u in free if free.count(u) > 1)
            return f"free block queue holds block {dup} twice (a double free)"
        if 0 in free:
            return "free block queue holds the null block 0"
        if len(free) != self.block_pool.get_num_free_blocks():
            return (f"free block queue holds {len(free)} blocks but the pool counts "
                    f"{self.block_pool.get_num_free_blocks()} free")
        held = [u for u in free if self.block_pool.blocks[u].ref_cnt != 0]
        if held:
            return f"free block queue holds block {held[0]} with ref_cnt {self.block_pool.blocks[held[0]].ref_cnt}"
        return self._pool_problem()


class ComponentsView:
    """A pool as the harness sees it: the components of some KV cache groups."""

    cpu_copy_carries_mamba = False  # a preempted vLLM request keeps no copy: its KV is recomputed

    def __init__(self, components):
        self._components = list(components)

    def components(self):
        return list(self._components)


class BlockTables:
    """Token slots of a request's positions, read from the manager's block table of one group."""

    def __init__(self, family):
        self.family = family
        self.mamba_pool = None  # set by the family when the model has mamba layers

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        fam = self.family
        vreq = fam.by_row[row]
        return slots_of(fam.block_ids(vreq, "full"), fam.config.page_size, start, end)


class SwaTranslator:
    """The SWA group's slot for a full-group slot: same request, same position, its SWA block (0 when
    that block is the null block, i.e. outside the window)."""

    def __init__(self, family):
        self.family = family

    def translate(self, indices) -> torch.Tensor:
        fam = self.family
        ps = fam.config.page_size
        where = {}
        for vreq in fam.live.values():
            swa = fam.block_ids(vreq, "swa")
            for j, block in enumerate(fam.block_ids(vreq, "full")):
                where[block] = swa[j] if j < len(swa) else 0
        slots = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        out = [where.get(int(s) // ps, 0) * ps + int(s) % ps if where.get(int(s) // ps, 0) else 0
               for s in slots.tolist()]
        return torch.tensor(out, dtype=torch.int64)


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end, dtype=torch.int64)
    if not len(positions):
        return positions
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size
