"""SGLang's own admission and capacity checks, called where its scheduler calls them.

The adapter adds no capacity guard of its own: a guard the engine lacks would hide the engine's
bug. What decides, per call site:

* admitting a request (a new one, a resume, a PD pre-allocation): the scheduler's row budget,
  ``req_to_token_pool.available_size()`` (``Scheduler.get_num_allocatable_reqs``, and the PD decode
  loops' ``available_size() <= 0: break``), then SGLang's ``ensure_mamba_capacity`` (the decode
  scheduler's gate before it binds rows; it evicts from the tree where one holds mamba slots).
  Releases without ``ensure_mamba_capacity`` rely on their sizing instead: the configurator caps
  ``max_running_requests`` at the mamba slots (``resolve_max_num_reqs``), so a free row always has
  a free mamba slot; the adapter states that rule with the mamba allocator's own ``available_size``.
  If ``HybridReqToTokenPool.alloc`` still asserts after the gate said yes, nothing is given back:
  the assert is reported as what the pools did.
* a decode step: ``ScheduleBatch.check_decode_mem`` (SGLang's own method, borrowed onto a one-request
  batch stand-in, as the Req's retraction methods are borrowed), whose ``False`` makes the engine
  retract a victim as ``retract_decode`` does; after a speculative step, the allocator's own
  ``check_decode_capacity`` with the speculative estimate's token count (see ``decode_fits``).
* a prefill chunk: no pre-check. The scheduler's ``PrefillAdder`` budget reserves headroom for
  tokens it estimates a request will still decode (``new_token_ratio`` times ``max_new_tokens``),
  which the harness's requests do not have; the extend is attempted and the allocator's ``None``
  (or its leak, or its assert) is what the harness sees.
* ... but where the release has the adder's budget object (``allocator.create_prefill_budget``, 0.5.23
  on), a request's first extend is also put to it, as ``PrefillAdder.add_one_req`` puts a request to
  ``memory_budget.check_prefill``: SGLang then allocates what the budget admitted and treats a ``None``
  as fatal ("Prefill out of memory"), so an admitted extend the allocator cannot place is a crash of
  the scheduler, reported as ``OverAdmitted`` (``prefill_admitted``). A budget that says no decides
  nothing here: the harness's requests decode no headroom the adder would reserve.

A plain decode that ``check_decode_mem`` lets through and the allocator then refuses is ``OverAdmitted``
too: the scheduler raises "Decode out of memory" on that ``None``. (Not claimed after a kept speculative
page, whose allocation SGLang's speculative path makes its own way, nor where the release has no check.)

Once SGLang's check has said no, the adapter only names the space that is short (for the harness's
outcome comparison); where it finds none, the exhaustion is reported against ``full``, and the
reference model's disagreement is the finding.
"""

from __future__ import annotations

import inspect

from poolfuzz.adapters.sglang.api import call_with
from poolfuzz.adapters.sglang.compat import speculative_decode_helpers
from poolfuzz.pools.errors import PoolError, PoolExhausted


class OverAdmitted(PoolError):
    """SGLang's own check admitted an allocation that its allocator then could not place: the scheduler
    allocates what its checks admitted and raises on a ``None`` (``mem_cache.allocation``)."""

    def __init__(self, *, admitted_by: str, what: str, crash: str, exhausted: PoolExhausted):
        self.space = exhausted.space
        self.requested = exhausted.requested
        self.available = exhausted.available
        super().__init__(f"SGLang's {admitted_by} admitted {what}, then the allocator could not place it "
                         f"({exhausted}); the scheduler raises '{crash}' there")


CHECK_DECODE_MEM = "ScheduleBatch.check_decode_mem"


class _NoSpeculation:
    """``ScheduleBatch.spec_algorithm`` of a batch without speculative decoding."""

    @staticmethod
    def is_none() -> bool:
        return True


class _DecodeBatch:
    """A one-request stand-in for ``ScheduleBatch`` carrying SGLang's own decode-memory methods."""

    spec_algorithm = _NoSpeculation()
    is_spec_v2 = False

    def __init__(self, *, reqs, allocator, tree_cache):
        self.reqs = reqs
        self.token_to_kv_pool_allocator = allocator
        self.tree_cache = tree_cache


_BATCH_METHODS = ("check_decode_mem", "new_tokens_required_next_decode")


def decode_batch_class(schedule_batch_cls) -> type | None:
    """``_DecodeBatch`` with ``check_decode_mem`` and the methods it calls borrowed from ``ScheduleBatch``
    (None where the release has no ``check_decode_mem``)."""
    if schedule_batch_cls is None or inspect.getattr_static(schedule_batch_cls, "check_decode_mem", None) is None:
        return None
    methods = {}
    for name in _BATCH_METHODS + speculative_decode_helpers(schedule_batch_cls):
        attr = inspect.getattr_static(schedule_batch_cls, name, None)
        if inspect.isfunction(attr):
            methods[name] = attr
    return type("SGLangDecodeBatchStandIn", (_DecodeBatch,), methods)


class SchedulerAdmission:
    """The checks SGLang's scheduler runs before it allocates (see the module docstring)."""

    def __init__(self, api):
        self.ensure_mamba_capacity = api.ensure_mamba_capacity
        self.batch_cls = decode_batch_class(api.ScheduleBatch)
        self.tree_cache = None  # the tree the checks may evict from; None: a chunk cache
        self._budget_cache = None  # what the prefill budget reads where no tree is driven (built once)

    def admit(self, family, sg) -> None:
        """Raise PoolExhausted where the scheduler would not admit ``sg`` now."""
        pool = family.sg_req_pool
        if pool.available_size() <= 0:
            raise PoolExhausted(space="rows", requested=1, available=pool.available_size())
        if not family.has_recurrent_state() or _holds_mamba(sg):
            return
        owner = getattr(pool, "mamba_allocator", None) or pool.mamba_pool
        if self.ensure_mamba_capacity is not None:
            fits = self.ensure_mamba_capacity(pool, [sg], self.tree_cache)
        else:  # the sizing rule these releases rely on: a free row has a free mamba slot
            fits = owner.available_size() >= 1
        if not fits:
            raise PoolExhausted(space="mamba", requested=1, available=owner.available_size())

    def decode_fits(self, family, sg, *, new_tokens: int) -> bool:
        """Whether the scheduler lets ``sg``'s next decode allocation (``new_tokens`` slots, page
        growth included) go ahead.

        A plain decode (nothing allocated past the committed tokens): ``check_decode_mem`` for a batch
        of ``sg`` alone. After a speculative step kept a page (allocated past committed), SGLang's
        speculative estimate (``_new_tokens_required_next_decode_spec_v2``) counts the allocation's page
        growth, which needs the speculative server arguments; the adapter gives that count to the
        allocator's own gate, ``check_decode_capacity`` (what ``check_decode_mem`` calls), or to the
        ``available_size() >= tokens`` comparison of releases without it.
        """
        alloc = family.sg_allocator
        gate = self.decode_gate(family, sg)
        if gate == CHECK_DECODE_MEM:
            batch = self.batch_cls(reqs=[sg], allocator=alloc, tree_cache=self.tree_cache)
            return bool(batch.check_decode_mem())
        if gate is not None:
            # 0.5.19's gate takes the count and the tree only; 0.5.20 on also the batch's requests
            return bool(call_with(alloc.check_decode_capacity, num_tokens=new_tokens, tree_cache=self.tree_cache,
                                  requests=[sg], spec_algorithm=None))
        return alloc.available_size() >= new_tokens

    def decode_gate(self, family, sg) -> str | None:
        """Which of SGLang's checks ``decode_fits`` asks for ``sg``'s next decode; None where the release has
        neither and the adapter compares ``available_size()`` itself."""
        if self.batch_cls is not None and sg.kv_allocated_len == sg.kv_committed_len:
            return CHECK_DECODE_MEM
        if hasattr(family.sg_allocator, "check_decode_capacity"):
            return f"{type(family.sg_allocator).__name__}.check_decode_capacity"
        return None

    def prefill_admitted(self, family, *, prefix_len: int, seq_len: int) -> str | None:
        """The name of the adder's budget where it admits a request's first extend (``prefix_len`` cached,
        up to ``seq_len``) whole, as ``add_one_req`` asks it; None where it says no or the release has none.

        No decode headroom is asked for (the harness's requests have no ``max_new_tokens``), and no chunk
        limit, so the budget admits the whole extend or nothing. ``total_tokens`` is the adder's: the
        extend, one page of allocation rounding (``per_req_token_overhead`` without KV sharding) and the
        allocator's own request-slot reserve, for a request the adder sees before it binds a row."""
        alloc = family.sg_allocator
        create = getattr(alloc, "create_prefill_budget", None)
        if create is None:
            return None
        cache = self.tree_cache if self.tree_cache is not None else self._chunk_cache(family)
        budget = create(cache, num_mixed_decode_tokens=0)
        extend = seq_len - prefix_len
        total = extend + alloc.page_size
        reserve = getattr(alloc, "request_slot_reserve", None)
        if reserve is not None:
            total += reserve(has_req_pool_slot=False, prefill_tokens=seq_len)
        admitted, _ = call_with(budget.check_prefill, extend_input_len=extend, total_tokens=total, max_new_tokens=0,
                                input_tokens=seq_len, swa_host_hit_length=0, chunk_limit=None)
        return type(budget).__name__ if admitted else None

    def _chunk_cache(self, family):
        """The cache the scheduler runs without a prefix tree (the registry's, radix cache disabled): the
        budget reads its evictable sizes (none) and the model's window from it."""
        if self._budget_cache is None:
            # imported here: tree_build imports SGLang's registry, which a release without a budget never needs
            from poolfuzz.adapters.sglang.tree.tree_build import build_disabled_cache

            self._budget_cache = build_disabled_cache(family)
        return self._budget_cache


def _holds_mamba(sg) -> bool:
    return getattr(sg, "mamba_pool_idx", None) is not None
