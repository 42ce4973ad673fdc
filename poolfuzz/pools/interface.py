"""The pool-family interface: every attribute and method the harness reads or calls on a family.

A family is one serving node's pools for one model. The harness builds one per node (a prefill
and a decode node) for every Hypothesis example, through a *factory*
``factory(config, *, device, faults, backup_mode)``, and drives it only through what is declared
here (``poolfuzz.harness.contract.check_family`` checks a family against it). The harness owns the
request record (:class:`poolfuzz.pools.request.ReqKv`) it passes to the protocol; the family fills
in its slot ids and lengths and, on retraction, its ``retraction_backup``.

Optional capabilities, which a family declares as attributes and the harness reads once per family
into a typed record (:func:`poolfuzz.pools.capabilities.capabilities_of`: a misspelt or mistyped one
is a ConfigError, never a silent default; a family that declares none gets the defaults below):

* ``supports_fork`` / ``supports_transfer`` (class attributes, default True): False makes the
  state machine skip the ``fork`` / ``transfer`` rules for this family;
* ``factory.unsupported_reason(config) -> str | None``: the configs a factory declines, saying why
  (``poolfuzz run`` skips them instead of failing on them);
* ``reference_factory`` (default None: :class:`poolfuzz.pools.reference.ReferenceFamily`): the
  reference model of an engine that counts capacity its own way, ``reference_factory(config,
  backup_mode=..., resume_swa_tail_only=...)`` (vLLM: one block pool for every KV cache group);
* ``pools_origin`` (default None): a :class:`poolfuzz.pools.capabilities.PoolsOrigin` saying who built the
  family's pools (poolfuzz, the engine's own code for the config's server, or the adapter's wiring) and how; a
  run counts its examples by it and an artifact records the failing example's;
* ``prefix_caching`` (default False): True makes the engine ask ``protocol.lookup(req, family)``
  before a resume what the prefix cache found, and pass it to the reference's ``resume``;
* ``ReqKv.recompute_from``: set by a resume that recomputes instead of restoring; the engine then
  writes the KV of positions from there on again;
* ``resume_swa_tail_only`` (default True): a paged SWA resume gives SWA slots to the window's tail
  only, the positions before it counting as evicted; False where it gives every position one (SGLang
  before ``alloc_extend_swa_tail``, up to 0.5.11), which the reference then expects;
* ``pads_slot_zero`` (default True): False where a padded batch writes nowhere (vLLM pads with -1);
* ``shared_unit_spaces`` (default ()): spaces whose units come from one pool; a unit held in two of
  them, or whose free list's ``ref_count(unit)`` is not its number of holders, is a violation;
* ``caches_freed_units`` (default False): freed units keep their contents (a prefix cache), so the
  family reports a unit to the free listener only when it leaves the cache.
* ``cached_units() -> dict[space, list[int]]`` and ``flush_prefix_cache()``: a family with a prefix
  cache says which units the cache holds for itself (counted as held: never free, never twice), and
  evicts every unlocked entry when the harness drains the node (the pools must then be whole).
* ``flush_cache()`` (default: none, the ``flush`` rule is skipped): an idle server's cache flush
  (SGLang's ``Scheduler.flush_cache``): the prefix cache dropped, not evicted, and the pools reset in
  place; the engine calls it on a node with no request left and then finds every pool whole.
* ``idle_problem() -> str | None`` (default: none): the engine's own idle memory check on a node with no
  request left (SGLang's ``Scheduler.on_idle`` leak check), asked before a flush and at the drain; what
  it reports is a failure (``engine-idle-check``).
* ``kv_pool.writes_through_engine`` (default False): the forward hands its KV rows to
  ``kv_pool.write_rows(slots, {(component, layer): rows}) -> keys written`` (the engine's own write
  door) instead of writing the buffers; the rest it writes itself. ``kv_pool.write_verified_rows(slots,
  rows, committed=) -> keys written`` (optional): a chain verify's window through a door that commits only
  the verified prefix, the first ``committed`` rows of each key (SGLang's ``set_kv_buffer_prefix_valid``,
  as DFlash commits a verify); the rejected drafts' rows of those keys are never written.
* ``req_pool.mamba_pool.spec_scratch`` (default None): speculative decoding's scratch, whose
  ``components()`` (``rows`` space, one per draft step) a verify forward writes before
  ``protocol.commit_speculative(req, family, accepted_step=, drafted_steps=, track_slot=)``;
  ``req_pool.get_track_slots(row)`` (optional): extra-buffer track slots as the kernels read them.
* ``supports_tree_drafts`` (class attribute, default False): speculative verify over a draft *tree*
  (EAGLE with topk > 1, NGRAM): the accepted path's KV is written where its tree nodes sit in the
  verify window, then ``protocol.move_accepted(req, family, tgt=, src=)`` moves it to the window's front
  (full slot ids), before the tail is freed. Only for configs without speculative scratch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, runtime_checkable

import torch

from poolfuzz.pools.components import Component
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.request import ReqKv

FreeListener = Callable[[str, torch.Tensor], None]  # (index space, token slots freed)


@runtime_checkable
class FreeListLike(Protocol):
    """One index space's allocator, in its units: pages for token spaces, slots or rows else."""

    on_free: FreeListener | None  # set by the harness; called with the slots of every free

    def available_size(self) -> int:
        """Free capacity in slots (pages x page size for token spaces), as SGLang counts it."""

    def is_free_page(self, unit: int) -> bool: ...

    def free_pages(self) -> list[int]:
        """The free units, in hand-out order."""

    def free_list_problem(self) -> str | None:
        """What is wrong with the free list (a unit listed twice, a reserved unit listed), or None."""


@runtime_checkable
class ComponentPool(Protocol):
    """A pool whose buffers hold request state, each addressed by one index space."""

    def components(self) -> list[Component]: ...


@runtime_checkable
class KVPoolLike(ComponentPool, Protocol):
    # Class attribute: does ``get_cpu_copy`` carry the recurrent state too? The harness audits the
    # declaration against what every retraction backup really held.
    cpu_copy_carries_mamba: bool


@runtime_checkable
class ReqPoolLike(Protocol):
    mamba_pool: ComponentPool | None  # the recurrent-state pool, or None for attention-only models

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """The full-KV token slots of positions ``[start, end)`` of a request row (int64, CPU)."""

    # Families whose kernels find the recurrent state through a row mapping also answer
    # ``get_mamba_indices(rows) -> torch.Tensor``: the mamba slot of each row as the kernels read it
    # (SGLang's row-to-mamba-slot mapping; the built-in pools have it too). The harness checks it against
    # the slot the request holds, so a pool that never writes the mapping fails. A family without the
    # method has no such mapping to check.


@runtime_checkable
class AllocatorLike(Protocol):
    def translate(self, indices) -> torch.Tensor:
        """SWA families: the SWA slot of each full token slot, 0 where unmapped (int64, CPU)."""


@runtime_checkable
class ServingProtocolLike(Protocol):
    """The request lifecycle in the engine's call order; a full pool raises PoolExhausted(space)
    and leaves nothing allocated, any other misuse raises a PoolError."""

    def admit(self, req: ReqKv, family) -> None: ...

    def extend(self, req: ReqKv, family, new_len: int): ...

    def run_deferred_mamba_ops(self, reqs: list[ReqKv], family) -> None: ...

    def free_speculative_tail(self, req: ReqKv, family) -> None: ...

    def evict_swa(self, req: ReqKv, family, pre_len: int) -> None: ...

    def retract(self, req: ReqKv, family) -> None: ...

    def resume(self, req: ReqKv, family) -> None: ...

    def pre_alloc(self, req: ReqKv, family, fill_len: int) -> None: ...

    def release_kv(self, req: ReqKv, family) -> None: ...

    def abort(self, req: ReqKv, family) -> None: ...

    # Optional: ``move_accepted(req, family, *, tgt, src)`` (see ``supports_tree_drafts``).
    # Optional: ``finish(req, family)``, a finished request's release (the engine calls it where the
    # protocol has it, else ``release_kv``): the built-in protocol brackets it with a free group.

    def fork(self, src: ReqKv, dst: ReqKv, family) -> None: ...


@runtime_checkable
class TransferLike(Protocol):
    def transfer(self, *, src: ReqKv, src_family, dst: ReqKv, dst_family):
        """PD: move one request's state to ``dst_family``; returns a record with ``state_types``.
        Only the prefill node's family's ``transfer`` is called."""


@runtime_checkable
class PoolFamilyInterface(Protocol):
    """Everything the harness uses of a family."""

    config: ModelConfig
    device: torch.device
    backup_mode: str  # the retraction path this family runs: "cpu_tensor" or "host_pool"
    uses_ssm_state: bool  # the family's SSM predicate for its config (audited against its pools)
    req_pool: ReqPoolLike
    kv_pool: KVPoolLike
    allocator: AllocatorLike
    protocol: ServingProtocolLike
    transfer: TransferLike | None  # None only where supports_transfer is False
    host_pools: dict[str, ComponentPool]  # by host space ("host.full", ...), for host_pool backups

    def components(self) -> list[Component]:
        """Every device buffer a request's state lives in, each addressed by one index space."""

    def host_components(self) -> list[Component]: ...

    def has_recurrent_state(self) -> bool: ...

    def free_lists(self) -> dict[str, FreeListLike]:
        """Every allocator by index space: ``rows``, ``full``, and ``swa``, ``mamba``, ``host.*``
        where the family has them. The harness compares each with its reference every step."""

    def set_free_listener(self, listener: FreeListener | None) -> None:
        """Call ``listener(space, slots)`` after every free in every space (the harness poisons them)."""


class FamilyFactory(Protocol):
    """Builds one family; called once per node (twice per example) and once per replay node."""

    def __call__(self, config: ModelConfig, *, device, faults: Iterable[str],
                 backup_mode: str | None) -> PoolFamilyInterface: ...
