"""Everything the vllm family needs of the installed vLLM, in one list, checked once per process.

The family reads vLLM through public names only (no attribute whose name starts with ``_``): block
tables through ``KVCacheManager.get_block_ids``, the prefix cache through each block's
``block_hash`` and ``BlockHashToBlockMap.contain``. What it needs is listed here as
:class:`~poolfuzz.adapters.engine_api.Need` records: a needed one that a release lacks or has reshaped
is an ``EngineApiChanged`` (verdict "API CHANGED", exit 2, no artifact), never a finding; an optional
one is a feature the family probes and does without. ``poolfuzz doctor --family vllm`` prints them.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from poolfuzz.adapters.engine_api import EngineReport, Need, Probe, report, require
from poolfuzz.errors import EngineApiChanged

ENGINE = "vllm"
INSTALL_HINT = ("install one with `ci/vllm-install.sh VENV 0.34.0` (CPU torch, vLLM without its CUDA "
                "dependencies) and run poolfuzz with that venv's python")
_CORE = "vllm.v1.core"

# Parameters are checked only where the family passes them by keyword (the constructors).
NEEDS: tuple[Need, ...] = (
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager", params=("kv_cache_config", "max_model_len", "enable_caching"),
         used_for="the manager every config drives"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.allocate_slots",
         used_for="every prefill chunk, decode and resume"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.get_computed_blocks",
         used_for="prefix hits at resume and next turn"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.get_block_ids",
         used_for="each request's block table per KV cache group"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.free", used_for="finished requests"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.reset_prefix_cache", used_for="the idle flush and the drain"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.remove_skipped_blocks",
         used_for="sliding-window eviction"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.take_events", used_for="the KV events a router reads"),
    Need(target=f"{_CORE}.block_pool:BlockPool.get_num_free_blocks", used_for="free counts"),
    Need(target=f"{_CORE}.block_pool:BlockPool.free_blocks",
         used_for="returning retained and popped blocks"),
    Need(target=f"{_CORE}.kv_cache_utils:FreeKVCacheBlockQueue.get_all_free_blocks", used_for="the free-list audit"),
    Need(target=f"{_CORE}.kv_cache_utils:KVCacheBlock", fields=("block_id", "ref_cnt", "is_null"),
         used_for="block audits"),
    Need(target=f"{_CORE}.kv_cache_utils:KVCacheBlock.block_hash", used_for="which blocks the prefix cache holds"),
    Need(target=f"{_CORE}.kv_cache_utils:get_request_block_hasher",
         used_for="request block hashes"),
    Need(target=f"{_CORE}.kv_cache_utils:init_none_hash", used_for="request block hashes"),
    Need(target="vllm.v1.kv_cache_interface:KVCacheConfig", fields=("num_blocks", "kv_cache_tensors", "kv_cache_groups"),
         used_for="the KV cache layout"),
    Need(target="vllm.v1.kv_cache_interface:KVCacheGroupSpec", used_for="the KV cache groups"),
    Need(target="vllm.v1.kv_cache_interface:FullAttentionSpec", used_for="full-attention layers"),
    Need(target="vllm.v1.kv_cache_interface:SlidingWindowSpec", fields=("sliding_window",),
         used_for="sliding-window layers"),
    Need(target="vllm.v1.kv_cache_interface:MambaSpec", fields=("shapes", "dtypes"), used_for="mamba layers"),
    Need(target="vllm.v1.request:Request", params=("request_id", "prompt_token_ids", "sampling_params",
                                                   "pooling_params", "block_hasher"), used_for="every request"),
    Need(target="vllm.v1.request:RequestStatus", used_for="a next turn's status while it is scheduled"),
    Need(target="vllm.sampling_params:SamplingParams", used_for="every request"),
    # Features the family probes and does without (a release without them runs fewer paths).
    Need(target="vllm.v1.kv_cache_interface:MambaSpec", fields=("mamba_cache_mode",), required=False,
         used_for='mamba "align" configs (absent: declined)'),
    Need(target=f"{_CORE}.block_pool:BlockHashToBlockMap.contain", required=False,
         used_for="which block a cached hash holds (absent: get_one_block, whether it holds one)"),
    Need(target=f"{_CORE}.block_pool:BlockHashToBlockMap.get_one_block", required=False,
         used_for="checking the KV events against the prefix cache (absent with contain: not checked)"),
    Need(target="vllm.distributed.kv_events:BlockStored", fields=("group_idx", "block_hashes"), required=False,
         used_for="KV events naming their group (absent: the events are not checked)"),
    Need(target=f"{_CORE}.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies", required=False,
         used_for="copy-on-write of state and partial-hit blocks"),
    Need(target=f"{_CORE}.kv_cache_utils:partial_hash_hits_enabled", required=False,
         used_for="prefix hits inside a block (--prefix-match-unit)"),
    Need(target=f"{_CORE}.block_pool:BlockPool.cache_partial_block", required=False,
         used_for="partial keys of a block (read from the pool's cached_block_hashes_by_block)"),
    Need(target=f"{_CORE}.kv_cache_metrics:KVCacheMetricsCollector", required=False, used_for="KV cache metrics"),
    # The scheduler-driven path (adapters/vllm/scheduling.py, tests/vllm/test_vllm_scheduling.py; issue 30).
    Need(target=f"{_CORE}.sched.scheduler:Scheduler", params=("vllm_config", "kv_cache_config",
                                                               "structured_output_manager"), required=False,
         used_for="the scheduler-driven path: vLLM's own Scheduler"),
    Need(target="vllm.v1.outputs:ModelRunnerOutput", params=("req_ids", "sampled_token_ids"), required=False,
         used_for="the scheduler-driven path: what the worker stand-in hands back"),
    Need(target="vllm.config:VllmConfig", params=("model_config", "scheduler_config", "cache_config",
                                                  "device_config"), required=False,
         used_for="the scheduler-driven path: the server's config, built on the CPU"),
    Need(target="vllm.v1.core.sched.output:SchedulerOutput",
         fields=("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids"),
         required=False, used_for="the scheduler-driven path: what the worker stand-in reads of each step"),
    Need(target=f"{_CORE}.sched.output:SchedulerOutput", fields=("kv_cache_block_copies",), required=False,
         used_for="copy-on-write of a hit's tail block on the scheduler-driven path (hits inside a block)"),
    Need(target="vllm.v1.core.sched.output:CachedRequestData",
         fields=("req_ids", "new_block_ids", "num_computed_tokens"), required=False,
         used_for="the scheduler-driven path: running and resumed requests' blocks"),
)
SCHEDULER_NEEDS = ("the scheduler-driven path",)  # the optional needs ``vllm`` requires


def release() -> str:
    from importlib.metadata import version

    return version("vllm")


def installed_release() -> str:
    """The installed vLLM's version; a ConfigError naming the install recipe where there is none."""
    from importlib.metadata import PackageNotFoundError

    from poolfuzz.errors import ConfigError

    try:
        return release()
    except PackageNotFoundError:
        raise ConfigError(f"vLLM is not installed here; {INSTALL_HINT}") from None


@lru_cache(maxsize=1)
def check() -> tuple[Probe, ...]:
    """Every needed entry point probed against the installed release (the optional ones are the doctor's:
    importing some, the scheduler's, costs seconds); EngineApiChanged for the first one missing."""
    return tuple(require([n for n in NEEDS if n.required], engine=ENGINE, release=release()))


def engine_report() -> EngineReport:
    """Every need probed, none raising (``poolfuzz doctor``); a ConfigError when vLLM is not installed."""
    return report(NEEDS, engine=ENGINE, release=installed_release())


def scheduler_engine_report() -> EngineReport:
    """``engine_report`` for ``--family vllm``: the scheduler path's needs are required there."""
    needs = tuple(dataclasses.replace(n, required=True) if n.used_for.startswith(SCHEDULER_NEEDS) else n
                  for n in NEEDS)
    return report(needs, engine=ENGINE, release=installed_release())


_SHAPE_SEEN: set[str] = set()  # answers whose shape was checked once in this process (a release is fixed under it)


def block_ids(manager, request_id: str, group: int, groups: int) -> list[int]:
    """The block ids of one KV cache group in a request's table (``KVCacheManager.get_block_ids``), checked
    to be one list of ints per group: a reshaped answer is an EngineApiChanged, not a crash of the pools.
    The container is checked on every call, the entries on the first that has any (a hot path)."""
    tables = manager.get_block_ids(request_id)
    if not isinstance(tables, (tuple, list)) or len(tables) != groups:
        raise EngineApiChanged(engine=ENGINE, release=release(), attribute="KVCacheManager.get_block_ids",
                               expected=f"one list of block ids per KV cache group ({groups})",
                               found=f"a {type(tables).__name__} of {len(tables) if hasattr(tables, '__len__') else '?'}")
    ids = tables[group]
    if ids and "get_block_ids" not in _SHAPE_SEEN:
        if not all(isinstance(b, int) for b in ids):
            raise EngineApiChanged(engine=ENGINE, release=release(), attribute="KVCacheManager.get_block_ids",
                                   expected="block ids (ints)", found=f"{type(next(iter(ids))).__name__} entries")
        _SHAPE_SEEN.add("get_block_ids")
    return list(ids)


class PrefixCacheView:
    """Which blocks a block pool's prefix cache holds, read through public names. How to ask is decided once,
    when the view is made; the map itself is read at each ask (a reset replaces it, before 0.34)."""

    def __init__(self, block_pool):
        self.block_pool = block_pool
        # Where the map answers whether it holds a given block (``contain``); before ~0.30 only which block a
        # key finds (``get_one_block``).
        self.by_block = hasattr(block_pool.cached_block_hash_to_block, "contain")
        # Partial keys of a block, where the release takes hits inside one (0.32 on).
        self.partial_keys = hasattr(block_pool, "cached_block_hashes_by_block")

    def keys(self) -> dict:
        """``{hash key: [block ids]}``: every block under its ``block_hash`` and its partial keys, each checked
        against the hash map; keys the map does not hold are returned under the key ``None``."""
        pool = self.block_pool
        cache = pool.cached_block_hash_to_block
        secondary = pool.cached_block_hashes_by_block if self.partial_keys else {}
        out: dict = {}
        for block in pool.blocks:
            primary = block.block_hash
            if primary is None or block.is_null:
                continue
            for key in (primary, *secondary.get(block.block_id, ())):
                held = cache.contain(key, block.block_id) if self.by_block else cache.get_one_block(key) is not None
                if not isinstance(held, bool):
                    raise EngineApiChanged(engine=ENGINE, release=release(), attribute="BlockHashToBlockMap.contain",
                                           expected="True or False", found=repr(held)[:40])
                out.setdefault(key if held else None, []).append(block.block_id)
        return out


@lru_cache(maxsize=1)
def _prompt_len_check():
    """``InputProcessor._validate_prompt_len`` where the release has it (0.17.0 on), else None; and what it raises
    (``vllm.exceptions.VLLMValidationError`` where there is one, else ValueError)."""
    from poolfuzz.adapters.engine_api import resolve

    try:
        check = resolve("vllm.v1.engine.input_processor:InputProcessor._validate_prompt_len")
    except (ImportError, AttributeError):
        return None, ValueError
    try:
        return check, resolve("vllm.exceptions:VLLMValidationError")
    except (ImportError, AttributeError):
        return check, ValueError


def prompt_refusal(model_config, prompt_len: int) -> str | None:
    """What vLLM's front end says of a decoder prompt of ``prompt_len`` tokens (it never reaches the scheduler
    then), or None where it takes it. Where the release has ``InputProcessor._validate_prompt_len`` (private,
    0.17.0 on) it is run unbound on a stand-in processor that holds only what it reads for a text-only decoder
    prompt (the model config; no multimodal inputs, the length check on): the processor itself needs a tokenizer
    and a renderer. 0.16.0 checks inside ``_validate_model_input``, which needs those: its rule stands here, as
    written there (input_processor.py 0.16.0:727-775: a prompt of max_model_len tokens or more)."""
    import types

    check, refused = _prompt_len_check()
    if check is None:
        limit = model_config.max_model_len
        return None if prompt_len < limit else f"the decoder prompt (length {prompt_len}) leaves no room under {limit}"
    processor = types.SimpleNamespace(model_config=model_config, skip_prompt_length_check=False,
                                      supports_mm_inputs=False, mm_encoder_cache_size=0)
    try:
        check(processor, prompt_len, "decoder")
    except (ValueError, refused) as exc:
        return str(exc).split(". Make sure")[0]
    return None
