"""A model runner's calls around SGLang's KV cache configurator, made as each release's runner makes them, and the
stand-ins for what a GPU would answer while the configurator builds (``configurator.py`` drives them).

Before 0.5.22 a scheduler publishes its server arguments without its ranks: they are its model runner's
``ParallelState`` (one rank here, SGLang's own ``ParallelState.trivial``), which the runner passes to its parallel
groups and its configurator, and its layer split takes the speculative algorithm and is narrowed for a hybrid SWA
model (``adjust_hybrid_swa_layer_ids``). From 0.5.22 the scheduler publishes its ranks (``SpawnRanks``) and the
runner holds none. Every name read here is private to SGLang and listed in ``compat.needs.PRIVATE``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
import warnings
from unittest import mock

from poolfuzz.adapters.sglang.compat import dcp_size, has_private, private, private_module, private_name


def publish_as_scheduler(args) -> None:
    """``args`` published as a one-rank scheduler process publishes them: with its ranks (``SpawnRanks``, 0.5.22 on),
    or, before 0.5.22, alone (its ranks are its model runner's, ``runner_ranks``); on 0.5.16, which has no
    ``publish``, as its model runner publishes them (``set_global_server_args_for_scheduler``, into the context)."""
    if not has_private("runtime_publish"):
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
        return
    publish = private("runtime_publish")
    if has_private("spawn_ranks"):
        publish(args, role="scheduler", ranks=private("spawn_ranks")(world_rank=0, dp_rank=None, gpu_id=0))
    else:
        publish(args, role="scheduler")


def runner_ranks():
    """A one-rank server's ``ParallelState`` (SGLang's own ``ParallelState.trivial``, as its attention test kits build
    one), which a model runner holds before 0.5.22; None where the release has none (its runner holds no ranks)."""
    return private("parallel_state").trivial() if has_private("parallel_state") else None


def group_ranks(args, model_dir: str) -> dict:
    """What a runner before 0.5.22 passes its parallel groups beside the server arguments: its ranks and its model
    config (read on this machine; its DP-attention context is one rank's); {} from 0.5.22 (they are published)."""
    ps = runner_ranks()
    if ps is None:
        return {}
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig

    return dict(model_config=SGLangModelConfig.from_server_args(args, model_path=model_dir), tp_rank=ps.tp_rank,
                tp_size=ps.tp_size, pp_rank=ps.pp_rank, pp_size=ps.pp_size, attn_dp_size=ps.attn_dp_size,
                attn_cp_size=ps.attn_cp_size, moe_ep_size=ps.moe_ep_size, moe_dp_size=ps.moe_dp_size,
                dcp_size=dcp_size(ps))


def layer_split(model, model_config, draft: bool, spec_algorithm):
    """The runner's layer split (``resolve_layer_indices``), called as this release's runner calls it: before 0.5.22
    with its speculative algorithm, and followed by ``adjust_hybrid_swa_layer_ids`` (which narrows a hybrid SWA model
    config's layer ids to the runner's layers); from 0.5.22 with its draft model index (none: one draft model)."""
    resolve = private("resolve_layer_indices")
    if "spec_algorithm" in inspect.signature(resolve).parameters:
        info = resolve(model=model, model_config=model_config, is_draft_worker=draft, spec_algorithm=spec_algorithm)
    else:
        info = resolve(model=model, model_config=model_config, is_draft_worker=draft)
    if has_private("adjust_hybrid_swa_layer_ids"):
        private("adjust_hybrid_swa_layer_ids")(model_config=model_config, start_layer=info.start_layer,
                                               end_layer=info.end_layer, is_hybrid_swa=model_config.is_hybrid_swa)
    return info


@contextlib.contextmanager
def kv_copy_warmup_skipped():
    """A speculative server's pools (``enable_kv_cache_copy``) launch SGLang's tiled KV copy kernel once when built,
    copying dummy location 0 onto itself in every layer to warm the kernel up: a Triton launch (a GPU's), which moves
    nothing, stood in for by nothing. Any other call (a real move) is refused, not skipped: the pools' moves take
    SGLang's native torch path (``pools.calls.native_kv_move``, read when a pool is built)."""
    if not has_private("kv_copy_kernel"):
        yield
        return
    module = private_module("kv_copy_kernel")

    def warmup(data_ptrs, data_strides, tgt_loc, src_loc, *args, **kwargs):
        if bool(tgt_loc.any()) or bool(src_loc.any()):
            raise RuntimeError("the tiled KV copy kernel was called for a real move while pools were being built")

    with mock.patch.object(module, private_name("kv_copy_kernel"), warmup):
        yield


@contextlib.contextmanager
def fixed_free_memory(free_bytes: int):
    """The configurator's free-memory probe answered with ``free_bytes`` (``MEMORY_BUDGET`` where the flags' caps size
    the server; a memory-sized server's own) and its ``gc.collect`` before it skipped, for the span of one build: the
    rest of ``_profile_available_bytes`` is SGLang's, its mamba budget among it (``_handle_max_mamba_cache``: the
    mamba slots a server gets, from ``--max-mamba-cache-size``, its running requests or its memory)."""
    # the configurator's probe, or before 0.5.16 the model runner's KV cache mixin's (``runner_pools``)
    probe = "configurator_free_memory" if has_private("configurator_free_memory") else "runner_free_memory"
    module = private_module(probe)
    budget_gb = free_bytes / (1 << 30)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, private_name(probe),
                                              lambda *a, **k: budget_gb))
        if has_private("configurator_gc"):  # 0.5.22 on: the probe collects first
            stack.enter_context(mock.patch.object(module, private_name("configurator_gc"),
                                                  types.SimpleNamespace(collect=lambda: 0)))
        yield


@contextlib.contextmanager
def sglang_quiet():
    """SGLang's warnings held back while a server is resolved (a CPU machine's fallbacks, printed at every build of
    every example, and warnings of its imports, which a warnings filter set to raise would turn into refusals); what
    refuses the server is raised, and reported."""
    logger = logging.getLogger("sglang")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
