"""SGLang's own idle memory check (``Scheduler.on_idle``), run on an idle node as a second oracle.

When no request is left, SGLang's scheduler checks, pool by pool, that ``available + evictable + protected
+ session_held == total`` (``SchedulerInvariantChecker._check_all_pools``) and that every request row is
free (``_check_req_pool``); with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` a violation kills the
scheduler, else it is logged. The adapter builds SGLang's own checker and statistics observer over the
family's tree, allocator and request pool, as ``Scheduler.init_invariant_checker`` does, and asks them.
What they report on a state poolfuzz finds whole is a false leak report of SGLang's (a scheduler crash in
strict mode, as sglang#20185's was); what they report that poolfuzz missed is a hole in poolfuzz's checks.
Either way it is a finding. Releases without the checker (it was split out of the scheduler in 0.5.2x) are
not asked.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import call_with
from poolfuzz.adapters.sglang.compat import private


class _NoSessions:
    """``Scheduler.session_controller`` with no streaming session open."""

    sessions: dict = {}


def invariant_checker_for(family):
    try:
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
    except ImportError:
        return None
    from sglang.srt.disaggregation.utils import DisaggregationMode

    c = family.config
    sizes = dict(
        is_hybrid_swa=c.has_swa, is_hybrid_ssm=c.has_mamba,
        # ModelRunner's full_/swa_max_total_num_tokens: the token allocators' sizes
        full_tokens_per_layer=c.full_tokens if c.has_full else 0,
        swa_tokens_per_layer=c.swa_tokens if c.has_swa else None,
        max_total_num_tokens=int(family.sg_allocator.size),
        tree_cache=family.tree, token_to_kv_pool_allocator=family.sg_allocator,
        req_to_token_pool=family.sg_req_pool)
    observer = call_with(SchedulerPoolStatsObserver, session_controller=_NoSessions(), hisparse_coordinator=None,
                         enable_hisparse=False, **sizes)
    return call_with(SchedulerInvariantChecker, pool_stats_observer=observer, page_size=c.page_size,
                     disaggregation_mode=DisaggregationMode.DECODE if family.pd_decode
                     else DisaggregationMode.NULL,
                     get_last_batch=lambda: None, get_running_batch=lambda: None, get_chunked_req=lambda: None,
                     scheduler_stage_metrics=None, **sizes), observer


def problem(family) -> str | None:
    """What SGLang's idle check reports on this node (its own words), or None: nothing, or no checker."""
    built = invariant_checker_for(family)
    if built is None:
        return None
    checker, observer = built
    has_leak, messages = private("check_all_pools")(checker, observer.get_pool_stats())
    found = [m for m in messages if m] if has_leak else []
    rows_before = checker.count_req_pool_leak_warnings
    try:  # raise_error_or_warn: raises in strict mode, else counts a warning
        private("check_req_pool")(checker)
    except ValueError as exc:
        found.append(str(exc).strip())
    else:
        if checker.count_req_pool_leak_warnings > rows_before:
            found.append("req_to_token_pool memory leak detected")
    return "; ".join(found) or None
