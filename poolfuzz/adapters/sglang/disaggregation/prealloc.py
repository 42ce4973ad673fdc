"""The PD decode server's pre-allocation gate, asked of SGLang's own allocator where its decode queue asks.

On a decode server (``disaggregation_mode="decode"``) a request that arrives from a prefill node, and a
retracted one that resumes, is pre-allocated by ``DecodePreallocQueue._pre_alloc``. Before it, the queue
(``pop_preallocated`` / ``resume_retracted_reqs``) checks, in this order: a free row, SGLang's
``ensure_mamba_capacity`` (both in :mod:`.admission`), then the allocator's own answers:

* ``prealloc_ceiling_fits(full, swa)``: could a demand this size ever be pre-allocated
  (``_check_if_req_exceed_kv_capacity``; None: the pool has no ceiling of its own);
* ``prealloc_fits(tree_cache, full, swa, full_budget_tokens=, swa_budget_tokens=)`` with the queue's
  budgets (``_allocatable_token_budgets`` / ``_swa_tail_allocatable_token_budget``): the full side's
  ``available_size()`` (``full_available_size()`` where SWA is reserved separately), the SWA side's from
  ``swa_capacity_and_available(full_capacity=size_full, swa_capacity=size_swa)``;
* ``reclaim_for_prealloc``: for a request arriving from a prefill node (``pop_preallocated``) wherever the SWA
  side is reserved on its own; for a resume (``resume_retracted_reqs``) only where
  ``prealloc_fits_assumes_reclaim()`` says the answer counted evictable pages.

The demands are ``_prealloc_required_tokens``': whole pages of the fill length, and of the window tail where
the release pre-allocates SWA for the tail only. The queue's policy terms are taken at the values of a
decode server that reserves no decode headroom (``num_reserved_decode_tokens = 0``) and has no request
running whose growth it must keep room for; a decode-side radix cache (the tree family's) adds what it can
evict. So the gate asks for what the allocation takes, and a "no" from it names the short space, as the
queue's ``break`` leaves the request waiting.
"""

from __future__ import annotations

from poolfuzz.pools.errors import PoolError, PoolExhausted
from poolfuzz.pools.protocol import window_start

DECODE = "decode"  # the node that plays SGLang's PD decode server


def _ceil(n: int, ps: int) -> int:
    return -(-n // ps) * ps


def uses_swa_tail_prealloc(family) -> bool:
    """``DecodePreallocQueue._uses_swa_tail_prealloc``: a paged SWA pool whose allocator has the tail call."""
    c = family.config
    return c.has_swa and c.page_size > 1 and hasattr(family.sg_allocator, "alloc_extend_swa_tail")


def required_tokens(family, fill_len: int) -> tuple[int, int]:
    """``_prealloc_required_tokens`` (no reserved decode tokens): (full, swa) tokens, in whole pages."""
    ps = family.config.page_size
    full = _ceil(fill_len, ps)
    if uses_swa_tail_prealloc(family) and family.resume_swa_tail_only:
        return full, _ceil(fill_len - window_start(family.config, fill_len), ps)
    return full, full


def radix_evictable(tree_cache, family) -> int:
    """``_radix_full_evictable``: what a decode-side radix cache can free on demand (0 for a chunk cache)."""
    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return 0
    if family.config.has_swa and hasattr(tree_cache, "full_evictable_size"):
        return int(tree_cache.full_evictable_size())
    return int(tree_cache.evictable_size())


def swa_reserved_apart(family) -> bool:
    """Does the queue budget the SWA side on its own? Else one budget, ``available_size()`` (the
    smaller side) plus the tree's full-evictable tokens, serves both."""
    return uses_swa_tail_prealloc(family) or _assumes_reclaim(family.sg_allocator)


def _evictable_by_space(tree_cache, family) -> dict[str, int]:
    """What the decode tree can evict for each side, as the queue's gate counts it, so that the side
    named short is the one the gate's eviction cannot cover (the reference names it so too)."""
    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return {}
    full = radix_evictable(tree_cache, family)
    if not family.config.has_swa:
        return {"full": full}
    if not swa_reserved_apart(family):  # one budget: the full-evictable tokens count for both sides
        return {"full": full, "swa": full}
    swa = getattr(tree_cache, "swa_evictable_size", None)
    return {"full": full, **({"swa": int(swa())} if swa is not None else {})}


def budgets(family, tree_cache=None) -> tuple[int, int | None]:
    """The queue's (full, swa) budgets; swa is None where the SWA side is not reserved on its own. A decode
    server with a radix cache (the tree family's) counts what the tree can evict, as
    ``disaggregation_decode_enable_radix_cache`` does; its allocation then evicts first."""
    alloc = family.sg_allocator
    evictable = radix_evictable(tree_cache, family)
    if not swa_reserved_apart(family):
        return alloc.available_size() + evictable, None
    full = alloc.full_available_size() + evictable
    # _swa_tail_allocatable_token_budget: what the SWA side has free (a chunk cache holds nothing evictable)
    _, (_, swa_available) = alloc.swa_capacity_and_available(full_capacity=alloc.size_full,
                                                            swa_capacity=alloc.size_swa)
    return full, swa_available


def _assumes_reclaim(alloc) -> bool:
    probe = getattr(alloc, "prealloc_fits_assumes_reclaim", None)
    return bool(probe()) if probe is not None else False


def gate_problem(api) -> str | None:
    """Why this release's allocators cannot answer the decode queue's pre-allocation questions, or None."""
    if not hasattr(api.TokenToKVPoolAllocator, "prealloc_fits"):
        return f"SGLang {api.version}'s allocators have no prealloc_fits (the decode queue counts for itself)"
    return None


def check(family, fill_len: int, tree_cache=None, *, arriving: bool = False) -> None:
    """Raise PoolExhausted where SGLang's decode queue would leave a ``fill_len`` pre-allocation waiting.
    ``arriving``: a transfer from the prefill node (else a resume of a retracted request)."""
    alloc = family.sg_allocator
    full, swa = required_tokens(family, fill_len)
    ceiling = alloc.prealloc_ceiling_fits(full, swa)
    if ceiling is False:  # the queue aborts such a request (BAD_REQUEST); no pool of these configs has a ceiling
        raise PoolError(f"SGLang's decode queue rejects a pre-allocation of {full} full / {swa} SWA tokens "
                        "(prealloc_ceiling_fits)")
    full_budget, swa_budget = budgets(family, tree_cache)
    if not alloc.prealloc_fits(tree_cache, full, swa, full_budget_tokens=full_budget,
                               swa_budget_tokens=swa_budget):
        # The queue's break leaves the request waiting; name the side that is short (one budget serves
        # both sides where available_size() is the smaller of the two)
        ps = family.config.page_size
        needs = {"full": full // ps, **({"swa": swa // ps} if family.config.has_swa else {})}
        short = family.space_short_of(needs, _evictable_by_space(tree_cache, family))
        space, requested, available = short or ("full", full, full_budget)
        raise PoolExhausted(space=space, requested=requested, available=available)
    if _assumes_reclaim(alloc) or (arriving and swa_budget is not None):
        shortfall = alloc.reclaim_for_prealloc(tree_cache, full, swa)
        if shortfall is not None:
            raise PoolExhausted(space="swa", requested=swa, available=alloc.swa_available_size())
