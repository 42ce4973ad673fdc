"""An external KV store behind vLLM's KV connector API: what a server with ``--kv-transfer-config`` runs.

The scheduler side is a real ``KVConnectorBase_V1`` plug-in (vLLM loads it by module path, as it loads
LMCache's): it answers ``get_num_new_matched_tokens`` from the whole blocks the store holds for a request's
token prefix, loads some of them synchronously and some asynchronously (the request waits in
``WAITING_FOR_REMOTE_KVS`` until the worker reports the load finished), and saves a finished request's
computed blocks asynchronously, so the scheduler holds its blocks until the worker reports the save done.
Which of vLLM's calls come, with which blocks and token counts, is vLLM's; this module only keeps the
store's index and hands the worker, in ``build_connector_meta``, what to load and save where.

The worker stand-in (``worker.py``) does the transfers on its tensors: a save copies the blocks' values
into the store under the request's token prefix (whatever the blocks hold: a block freed and reused too
early is saved wrong), a load copies the store's values into the blocks the scheduler allocated, and the
forward's checks then say whether every position attended holds the request's own KV. Stood in for: the
transport (the store is a dict in this process) and the worker-side connector (``start_load_kv``,
``save_kv_layer``: they need a forward context).
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
    blocks: tuple[int, ...]  # the request's full-attention block ids, from its first token
    start: int
    count: int
    report: bool = False  # say it finished (finished_recving / finished_sending) in the step's output


@dataclass(kw_only=True)
class StoreMeta:
    """What the scheduler hands the worker with a step (its ``kv_connector_metadata``)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class ExternalStore:
    """The store's index: which whole-block token prefixes it holds (the worker keeps the values)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.values: dict[tuple[int, ...], dict] = {}  # prefix through a block's end -> that block's values

    def longest(self, tokens) -> int:
        """The longest whole-block prefix of ``tokens`` the store holds, in tokens."""
        bs, n = self.block_size, 0
        while n + bs <= len(tokens) and tuple(tokens[:n + bs]) in self.values:
            n += bs
        return n


def __getattr__(name: str):
    """vLLM's factory takes ``StoreConnector`` from this module by name: built on first use, so that importing
    the module does not import vLLM (poolfuzz loads every module; vLLM may not be installed)."""
    if name == CONNECTOR:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@lru_cache(maxsize=1)
def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class StoreConnector(KVConnectorBase_V1):
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

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            tokens = list(request.all_token_ids)
            hit = self.store.longest(tokens[:len(tokens) - 1])  # a request computes at least its last token
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
            ids = blocks.get_block_ids()[0]
            self.meta.loads.append(Transfer(rid=rid, tokens=tuple(request.all_token_ids), blocks=tuple(ids),
                                            start=start, count=num_external_tokens, report=load_async))
            self.loaded += num_external_tokens

        def build_connector_meta(self, scheduler_output):
            meta, self.meta = self.meta, StoreMeta()
            return meta

        def request_finished(self, request, block_ids):
            ids = block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids
            full = min(request.num_computed_tokens, len(ids) * self.store.block_size) // self.store.block_size
            if not full:
                return False, None
            self.meta.saves.append(Transfer(rid=request.request_id, tokens=tuple(request.all_token_ids),
                                            blocks=tuple(ids), start=0, count=full * self.store.block_size, report=True))
            self.saved += full
            return True, None  # the worker saves them next step; the blocks stay held until it says so

    return StoreConnector
