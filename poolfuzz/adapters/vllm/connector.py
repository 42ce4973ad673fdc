"""An external KV store behind vLLM's KV connector API: what a server with ``--kv-transfer-config`` runs.

The scheduler side is a real ``KVConnectorBase_V1`` plug-in (vLLM loads it by module path, as it loads
LMCache's): it answers ``get_num_new_matched_tokens`` from the whole blocks the store holds for a request's
token prefix, loads some of them synchronously and some asynchronously (the request waits in
``WAITING_FOR_REMOTE_KVS`` until the worker reports the load finished), stores every scheduled request's
computed whole blocks as they fill (as vLLM's offloading connector does), and saves a finished request's
computed blocks asynchronously, so the scheduler holds its blocks until the worker reports the save done.
Which of vLLM's calls come, with which blocks and token counts, is vLLM's; this module only keeps the
store's index and hands the worker, in ``build_connector_meta``, what to load and save where.

The worker stand-in (``worker.py``) does the transfers on its tensors: a save copies the blocks' values
into the store under the request's token prefix (whatever the blocks hold: a block freed and reused too
early is saved wrong), a load copies the store's values into the blocks the scheduler allocated, and the
forward's checks then say whether every position attended holds the request's own KV. Stood in for: the
transport (the store is a dict in this process) and the worker-side connector (``start_load_kv``,
``save_kv_layer``: they need a forward context).

On a hybrid model the connector declares ``SupportsHMA`` (vLLM then hands it every KV cache group's blocks,
``request_finished_all_groups``) and ``supports_divergent_local_hybrid_hits`` (it restores a lagging mamba
state, as NIXL's does), so the scheduler's own hybrid-hit handling runs: the local hit cut to a block boundary
for the connector, a longer external hit superseding a hit's tail inside a block (``truncate_computed_blocks``),
a diverged hybrid hit reconciled when the store backs none of it. The store serves a prefix only where it holds
everything a forward after it reads: every full-attention block it loads, the sliding-window blocks of the
window before the prefix's end, and the recurrent state after exactly the prefix (a mamba "align" block's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

CONNECTOR = "StoreConnector"  # the class name vLLM's connector factory looks up in this module (``__getattr__``)


@dataclass(kw_only=True)
class Transfer:
    """One request's transfer: tokens ``[start, start + count)`` of ``tokens`` into or out of ``blocks``."""

    rid: str
    tokens: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]  # the request's block ids per KV cache group, from its first token
    start: int
    count: int
    report: bool = False  # say it finished (finished_recving / finished_sending) in the step's output


@dataclass(kw_only=True)
class StoreMeta:
    """What the scheduler hands the worker with a step (its ``kv_connector_metadata``)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # req id -> the tokens a scheduled request had computed before this step: the worker stores its whole blocks
    # (from the block tables the step's output gives) that the store lacks, as an offloading connector stores each
    # block once it is computed
    stores: dict[str, int] = field(default_factory=dict)


class ExternalStore:
    """The store's index: which whole-block token prefixes it holds, per KV cache group (the worker keeps the
    values: an entry maps a worker component key, ``(group, layer, k/v)`` or a state's ``(group, layer)``, to
    that block's values)."""

    def __init__(self, block_size: int, *, groups, window: int | None = None):
        self.block_size = block_size
        self.groups = tuple(groups)  # manager.Group per KV cache group
        self.window = window  # the sliding-window groups' attended span (the worker's), where there are any
        self.values: dict[tuple[int, ...], dict] = {}  # prefix through a block's end -> that block's values

    def _holds(self, prefix, group, kind: int) -> bool:
        entry = self.values.get(tuple(prefix))
        return entry is not None and any(len(key) == kind and key[0] == group.index for key in entry)

    def serves(self, tokens, start: int, end: int) -> bool:
        """Whether a load of ``[start, end)`` (block-aligned) leaves a forward from ``end`` all it reads."""
        bs = self.block_size
        for g in self.groups:
            if g.space == "mamba":
                if not self._holds(tokens[:end], g, 2):  # the state after exactly ``end`` tokens
                    return False
                continue
            low = start if g.space == "full" or self.window is None else max(start, (end - self.window) // bs * bs)
            if not all(self._holds(tokens[:i + bs], g, 3) for i in range(low, end, bs)):
                return False
        return True

    def longest(self, tokens, start: int = 0) -> int:
        """The longest whole-block prefix of ``tokens`` past ``start`` the store serves, in tokens (0: none)."""
        bs = self.block_size
        ends = range(len(tokens) // bs * bs, start, -bs)
        return next((end for end in ends if end > start and self.serves(tokens, start, end)), 0)


def __getattr__(name: str):
    """vLLM's factory takes ``StoreConnector`` from this module by name: built on first use, so that importing
    the module does not import vLLM (poolfuzz loads every module; vLLM may not be installed)."""
    if name == CONNECTOR:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hybrid_capable() -> bool:
    """Whether the store's connector runs on hybrid models with this release: its connector API takes a hybrid
    model's groups (``SupportsHMA``) and its scheduler handles a connector's hybrid hits (the base class has
    ``supports_divergent_local_hybrid_hits``, 0.34.0 here). Older releases keep the connector on full-attention
    models only: the store's hybrid hits rely on that handling. Judged (issue 30): forced onto 0.16.0's mamba
    "align" hybrids, the connector's first external hit kills the scheduler with vLLM's own
    ``AssertionError: External KV connector is not verified yet`` (``Scheduler._mamba_block_aligned_split``,
    scheduler.py:281 in 0.16.0), a real defect (vllm#45268, vllm#45407 on 0.22.1) that vllm#42554 fixed (0.23.0
    has no assert); the worker stand-in plays no part in it."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return hasattr(base, "SupportsHMA") and hasattr(base.KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")


@lru_cache(maxsize=1)
def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    # SupportsHMA where the release has it: vLLM then hands the connector every group's blocks (hybrid models)
    bases = (base.KVConnectorBase_V1,) + ((base.SupportsHMA,) if hasattr(base, "SupportsHMA") else ())

    class StoreConnector(*bases):
        """The scheduler's side of the store (see the module)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            self.store: ExternalStore | None = None  # attached by the driver: one store per server
            # req id -> (the local hit it was asked about, where its load starts; whether it loads asynchronously)
            self.asked: dict[str, tuple[int, bool]] = {}
            self.meta = StoreMeta()
            self.loaded = self.saved = 0  # tokens the scheduler asked to load / blocks saved (for the tests)

        def attach(self, store: ExternalStore) -> None:
            self.store = store

        # The worker role's methods: only a GPU worker's connector (role WORKER) is called with a forward context;
        # the worker stand-in does the transfers itself (worker.py), so none of these may ever run.
        def start_load_kv(self, forward_context, **kwargs):
            raise RuntimeError("the external store's worker side is worker.py's stand-in, not a worker connector")

        wait_for_layer_load = save_kv_layer = wait_for_save = start_load_kv

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return True  # the store loads the recurrent state after a hit's end with its KV (see the module)

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            tokens = list(request.all_token_ids)
            # a request computes at least its last token
            hit = self.store.longest(tokens[:len(tokens) - 1], num_computed_tokens)
            if hit <= num_computed_tokens:
                return 0, False
            load_async = int(request.request_id) % 2 == 0  # half the loads between steps: the request waits
            self.asked[request.request_id] = (num_computed_tokens, load_async)
            return hit - num_computed_tokens, load_async

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            if not num_external_tokens:
                return
            rid = request.request_id
            start, load_async = self.asked.pop(rid)
            ids = tuple(tuple(group) for group in blocks.get_block_ids())
            self.meta.loads.append(Transfer(rid=rid, tokens=tuple(request.all_token_ids), blocks=ids,
                                            start=start, count=num_external_tokens, report=load_async))
            self.loaded += num_external_tokens

        def build_connector_meta(self, scheduler_output):
            meta, self.meta = self.meta, StoreMeta()
            for new in scheduler_output.scheduled_new_reqs:
                meta.stores[new.req_id] = new.num_computed_tokens
            cached = scheduler_output.scheduled_cached_reqs
            meta.stores.update(zip(cached.req_ids, cached.num_computed_tokens))
            return meta

        def request_finished(self, request, block_ids):
            ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
            return self.request_finished_all_groups(request, (ids,))

        def request_finished_all_groups(self, request, block_ids):
            """The request's whole computed blocks, every group's, saved by the worker next step."""
            ids = tuple(tuple(group) for group in block_ids)
            full = request.num_computed_tokens // self.store.block_size
            if not full or not any(any(group) for group in ids):
                return False, None
            self.meta.saves.append(Transfer(rid=request.request_id, tokens=tuple(request.all_token_ids),
                                            blocks=ids, start=0, count=full * self.store.block_size, report=True))
            self.saved += full
            return True, None  # the worker saves them next step; the blocks stay held until it says so

    return StoreConnector
