"""The installed vLLM's v1 KV cache manager, imported once, with what this release offers (probed)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache

from poolfuzz.adapters.vllm import compat
from poolfuzz.adapters.vllm.compat import INSTALL_HINT  # re-exported: where the family's errors name the fix
from poolfuzz.pools.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class VllmAPI:
    """The classes and functions the adapter drives, and the feature probes of this release."""

    version: str
    KVCacheManager: type
    KVCacheConfig: type
    KVCacheGroupSpec: type
    FullAttentionSpec: type
    SlidingWindowSpec: type
    MambaSpec: type
    Request: type
    RequestStatus: type
    SamplingParams: type
    block_hasher: object  # get_request_block_hasher
    hash_fn: object
    manager_params: frozenset  # KVCacheManager's constructor parameters
    allocate_params: frozenset  # allocate_slots' parameters
    mamba_fields: frozenset  # MambaSpec's fields: "mamba_cache_mode" where the release has cache modes
    kv_cache_config_fields: frozenset  # KVCacheConfig's fields (prefix_cache_retention_interval, from ~0.30)
    request_params: frozenset  # Request's constructor parameters (eos_token_id, required before ~0.17)
    kv_cache_utils: object  # vllm.v1.core.kv_cache_utils (hash-key helpers)
    kv_events: object  # vllm.distributed.kv_events (what the scheduler publishes each step)
    metrics_collector: object  # KVCacheMetricsCollector where the release has one, else None
    # allocate_slots takes a step of no new tokens that only adopts a local hit (from ~0.30); before,
    # it refuses one without external tokens ("num_new_tokens must be greater than 0 ...")
    adopts_without_new_tokens: bool = False
    # A mamba "align" group takes prefix hits inside a block when block hashes are finer than its
    # blocks (``--prefix-match-unit``): the hit's tail block is copied on write (from ~0.32)
    partial_hash_hits: bool = False

    def new_request(self, request_id: str, prompt: list[int], block_size: int, *, max_tokens: int = 1 << 16,
                    priority: int = 0):
        """A real ``vllm.v1.request.Request`` with a block hasher, as this release constructs one."""
        kw = dict(request_id=request_id, prompt_token_ids=prompt, sampling_params=self.SamplingParams(max_tokens=max_tokens),
                  pooling_params=None, block_hasher=self.block_hasher(block_size, self.hash_fn))
        if priority:
            kw["priority"] = priority
        if "eos_token_id" in self.request_params:
            kw["eos_token_id"] = None
        return self.Request(**kw)

    @property
    def mamba_cache_modes(self) -> tuple[str, ...]:
        """The mamba cache modes this release's MambaSpec takes (none only where it has no field)."""
        return ("none", "align") if "mamba_cache_mode" in self.mamba_fields else ("none",)

    @property
    def takes_external_tokens(self) -> bool:
        return "num_external_computed_tokens" in self.allocate_params


@lru_cache(maxsize=1)
def load() -> VllmAPI:
    """Import vLLM's core modules (a ConfigError naming the fix when it is not installed)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM's import chain warns about its own use of torch APIs (torch.jit, ...): not ours to fail on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load()


def _load() -> VllmAPI:
    compat.installed_release()  # a ConfigError naming the install recipe where there is none
    compat.check()  # a release without what the family needs: EngineApiChanged, naming it
    try:
        from importlib.metadata import version as dist_version

        from vllm.distributed import kv_events
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                                SlidingWindowSpec)
        from vllm.v1.request import Request, RequestStatus
    except ImportError as exc:
        raise ConfigError(f"vLLM's v1 KV cache manager cannot be imported ({exc}); {INSTALL_HINT}") from None
    try:
        from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
    except ImportError:
        KVCacheMetricsCollector = None
    hash_fn = _hash_fn()
    kv_cache_utils.init_none_hash(hash_fn)
    return VllmAPI(
        version=dist_version("vllm"), KVCacheManager=KVCacheManager, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, FullAttentionSpec=FullAttentionSpec,
        SlidingWindowSpec=SlidingWindowSpec, MambaSpec=MambaSpec, Request=Request, RequestStatus=RequestStatus,
        SamplingParams=SamplingParams, block_hasher=kv_cache_utils.get_request_block_hasher, hash_fn=hash_fn,
        manager_params=frozenset(inspect.signature(KVCacheManager).parameters),
        allocate_params=frozenset(inspect.signature(KVCacheManager.allocate_slots).parameters),
        mamba_fields=frozenset(f.name for f in dataclasses.fields(MambaSpec)),
        kv_cache_config_fields=frozenset(f.name for f in dataclasses.fields(KVCacheConfig)),
        request_params=frozenset(inspect.signature(Request).parameters), kv_cache_utils=kv_cache_utils,
        kv_events=kv_events, metrics_collector=KVCacheMetricsCollector,
        adopts_without_new_tokens="computed tokens to adopt" in inspect.getsource(KVCacheManager.allocate_slots),
        partial_hash_hits=hasattr(kv_cache_utils, "partial_hash_hits_enabled"))


def _hash_fn():
    """sha256 over pickled keys, from wherever this release keeps it."""
    try:
        from vllm.utils.hashing import sha256
    except ImportError:
        from vllm.utils import sha256
    return sha256
