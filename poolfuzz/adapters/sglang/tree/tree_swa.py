"""The sliding window under SGLang's prefix tree: the decode-time window eviction the scheduler runs
(``ScheduleBatch.maybe_evict_swa`` with a tree that shares prefixes) and the SWA a request holds; the eviction
interval every SGLang family runs with (``pools/environment.py``: the servers' environment, ``server_environment``).

With a tree, an extend evicts no SWA of its own (the tree's checkpoint frees what slid out of the
window, ``SWAComponent.free_out_of_window_slots``); a decode evicts through
``tree_cache.evict_sliding_windows`` when the scheduler's trigger (``_swa_eviction_trigger``, with
``SGLANG_SWA_EVICTION_INTERVAL`` scaled to the harness's contexts: ``eviction_interval``) says it is
due. A request's SWA below its protected prefix is the tree's (live, or a tombstone the tree already
freed); it holds privately the SWA of ``[max(frontier, protected), allocated)``.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.compat import private
from poolfuzz.adapters.sglang.pools.environment import eviction_interval
from poolfuzz.pools.reference import pages_spanned


class _TriggerBatch:
    """What ``ScheduleBatch._swa_eviction_trigger`` reads of its batch off the ROCm path."""

    forward_iter = 0


def decoding(req, sg) -> bool:
    """The request has computed its whole prompt (its next forward is a decode)."""
    return req.kv_committed_len >= len(sg.origin_input_ids)


def evict_window(family, sg, pre_len: int) -> None:
    """``maybe_evict_swa``'s decode branch for one request, with the release's own trigger."""
    tree = family.tree
    interval = eviction_interval(family.config)
    # what maybe_evict_swa passes: the tree's retained window where it has one (0.5.23), else the
    # sliding window itself (0.5.22 and before)
    window = getattr(tree, "swa_retain_window", None)
    trigger = private("swa_eviction_trigger")  # ScheduleBatch's, run unbound on the stand-in batch
    due = trigger(_TriggerBatch(), tree.sliding_window_size if window is None else window, interval)
    if sg.kv.holds_kv and due(sg):
        tree.evict_sliding_windows(sg, pre_len, eviction_interval=1)


def frontier(family, sg) -> int:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return int(sg.kv.get_evicted_seqlen(ComponentType.SWA))


def private_swa_pages(reference) -> int:
    """SWA pages the live requests hold privately: ``[max(frontier, protected), allocated)`` each."""
    family, ps = reference.family, reference.ps
    total = 0
    for rid, req in reference.requests.items():
        sg = family.protocol.standins.get(rid)
        if not req.holds_row or sg is None or sg.kv is None or not req.allocated:
            continue
        lo = max(frontier(family, sg), int(sg.kv.cache_protected_len))
        total += max(0, pages_spanned(req.allocated, ps) - lo // ps)
    return total
