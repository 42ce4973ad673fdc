"""Row patterns shared by the pool tests: small distinct integers, exact in every store dtype."""

import torch

from poolfuzz.pools.request import ReqKv

MAMBA_POS = 999  # the "position" the recurrent state's pattern is derived from


def pattern(comp_i: int, rid: int, positions: list[int], row_shape, dtype) -> torch.Tensor:
    """Rows for (component, request, position): small distinct integers 1..250, exact in every store dtype."""
    numel = 1
    for d in row_shape:
        numel *= d
    base = torch.tensor([(rid * 61 + p * 7 + comp_i * 13) % 250 for p in positions], dtype=torch.int64)
    rows = (base[:, None] + torch.arange(numel)) % 250 + 1
    return rows.reshape(len(positions), *row_shape).to(dtype)


def rows_of(family, comp, req: ReqKv, positions: list[int]) -> tuple[list[int], list[int]]:
    """(positions, rows) of a component for a request; SWA positions without a mapped slot are dropped."""
    if comp.space == "mamba":
        return [MAMBA_POS], [req.mamba_pool_idx]
    full = family.req_pool.read(req.req_pool_idx, 0, max(positions) + 1)[positions]
    if comp.space == "full":
        return positions, full.tolist()
    swa = family.allocator.translate(full)
    keep = [i for i, s in enumerate(swa.tolist()) if s > 0]
    return [positions[i] for i in keep], [int(swa[i]) for i in keep]


def carried(family) -> list:
    """The components a retraction backup or a PD transfer carries: all but speculative scratch, which
    only lives from a verify to its commit (SGLang's MambaPool leaves its intermediate caches out of both)."""
    return [c for c in family.components() if c.space != "rows"]
