"""SGLang's speculative (spec v2) scheduling as the scheduler path calls it (``scheduler/spec_worker.py``): the
functions it runs, the Scheduler state ``run_batch`` reads, and the stand-in the mamba commit runs on."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace as NS

from poolfuzz.adapters.sglang.compat.scheduler import relay_future_map

# What the synchronous spec-v2 round runs, module:name (0.5.23), or a tuple of the homes a name has had, newest first:
# absent on a release, its servers are declined.
SPEC_V2 = {
    "spec_prepare_for_decode": "sglang.srt.speculative.spec_utils:spec_prepare_for_decode",
    "commit_mamba_states_after_verify": "sglang.srt.speculative.spec_utils:commit_mamba_states_after_verify",
    # the Triton kernel the target-verify prep launches on a GPU (its dispatcher returns nothing on a bare CPU)
    "assign_extend_cache_locs": "sglang.kernels.ops.speculative.cache_locs:assign_extend_cache_locs",
    "EagleDraftInput": "sglang.srt.speculative.eagle_info:EagleDraftInput",
    "GenerationBatchResult": "sglang.srt.managers.utils:GenerationBatchResult",
    # eagle_sample's greedy tree acceptance: verify_tree_greedy_func rejects a bare CPU (its CPU branch is sgl_kernel's,
    # behind SGLANG_USE_CPU_ENGINE); the Triton variant an XPU launches runs in the interpreter (in eagle_utils before
    # 0.5.23)
    "verify_tree_greedy": ("sglang.kernels.ops.speculative.spec_tree:verify_tree_greedy_triton",
                           "sglang.srt.speculative.eagle_utils:verify_tree_greedy_triton"),
    # private: a draft tree's accepted path moved to the front of the window (move_kv_cache), its tokens compacted
    "finalize_accept_tree_path": "sglang.srt.speculative.eagle_worker_common:_finalize_accept_tree_path",
    "update_mamba_state_after_mtp_verify": "sglang.srt.layers.attention.hybrid_linear_attn_backend:"
                                           "HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
}


# The commit's scatter module: its fused Triton kernels refuse CPU tensors ("only supports CUDA/XPU tensors"), where
# the backend's own torch scatter (the one it runs for its other side states off CUDA) does the same per request:
# ``dst[:, dst_indices[i]] = src[:, i, step_indices[i]]`` where ``step_indices[i] >= 0``.
SCATTER_MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
FUSED_SCATTERS = ("fused_mamba_state_scatter_with_mask", "fused_conv_window_scatter_with_mask")
MULTI_SCATTER_GATE = "_conv_multi_eligible"  # private: whether all conv pairs go through one fused launch
TORCH_SCATTER = ("sglang.srt.layers.attention.hybrid_linear_attn_backend:"
                 "HybridLinearAttnBackend._scatter_speculative_state_with_mask")


@contextmanager
def torch_state_scatter():
    """Within the block, the commit's fused scatter kernels are the backend's torch scatter (see ``FUSED_SCATTERS``),
    and the conv windows go through the per-pair loop ``scatter_mamba_states_after_mtp_verify`` runs when its
    multi-pair fusion is not eligible."""
    from poolfuzz.adapters.sglang.shims import swapped

    module = importlib.import_module(SCATTER_MODULE)
    twin = _resolve(TORCH_SCATTER)
    with ExitStack() as stack:
        for name in FUSED_SCATTERS:
            stack.enter_context(swapped(module, name, twin))
        stack.enter_context(swapped(module, MULTI_SCATTER_GATE, lambda pairs: False))
        yield


def _resolve(target: str | tuple[str, ...]):
    """``module:name`` (dotted), or the first of several homes that has it; ImportError or AttributeError if none."""
    if isinstance(target, tuple):
        for home in target[:-1]:
            try:
                return _resolve(home)
            except (ImportError, AttributeError):
                continue
        return _resolve(target[-1])
    module, _, name = target.partition(":")
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def spec_v2_missing() -> list[str]:
    """What the stand-in's speculative round calls (``SPEC_V2`` and the scatter's names) that this release lacks, each
    as ``module:name``: empty from 0.5.20 on (a probe of names, not of ``run_batch``'s branches)."""
    missing = []
    for target in (*SPEC_V2.values(), TORCH_SCATTER):
        try:
            _resolve(target)
        except (ImportError, AttributeError):
            missing.append(target if isinstance(target, str) else target[0])
    try:
        module = importlib.import_module(SCATTER_MODULE)
    except ImportError:
        return [*missing, SCATTER_MODULE]
    return [*missing, *(f"{SCATTER_MODULE}:{name}" for name in (*FUSED_SCATTERS, MULTI_SCATTER_GATE)
                        if not hasattr(module, name))]


def runs_spec_v2_synchronously() -> bool:
    """Whether this release has every name the stand-in's speculative round calls (:func:`spec_v2_missing`)."""
    return not spec_v2_missing()


def spec_v2_modules() -> NS:
    """The ``SPEC_V2`` names, resolved."""
    return NS(**{key: _resolve(target) for key, target in SPEC_V2.items()})


def verify_result(m: NS, *, accept_index, **fields):
    """The ``GenerationBatchResult`` of a verify round: ``fields``, and ``accept_index`` where the release's result has
    the field (0.5.21 on; only the pipeline-parallel mixin reads it)."""
    if "accept_index" in _field_names(m.GenerationBatchResult):
        fields["accept_index"] = accept_index
    return m.GenerationBatchResult(**fields)


@functools.cache
def _field_names(dataclass_type) -> frozenset:
    """A dataclass's field names, read once (a verify round asks each round)."""
    return frozenset(field.name for field in dataclasses.fields(dataclass_type))


def verify_cache_locs(m: NS, *, req_pool_indices, req_to_token, start_offset, draft_token_num: int):
    """The verify window's slots, ``req_to_token[row, start:start + draft_token_num]`` per request, gathered by the
    kernel ``eagle_prepare_for_verify`` launches on a GPU (``assign_extend_cache_locs_uniform_func``'s GPU branch, the
    uniform kernel's non-fused twin, launched as ``assign_extend_cache_locs_func`` launches it), here in Triton's
    interpreter."""
    import torch
    import triton

    bs = len(req_pool_indices)
    out = torch.empty((bs * draft_token_num,), dtype=torch.int64)
    m.assign_extend_cache_locs[(bs,)](req_pool_indices, req_to_token, start_offset, start_offset + draft_token_num,
                                      out, req_to_token.shape[1], triton.next_power_of_2(bs))
    return out


def run_batch_state(*, model_worker, spec_algorithm, req_to_token_pool) -> dict:
    """What ``Scheduler.run_batch`` reads of a one-rank server without the overlap schedule, beyond what
    ``scheduler_state`` leaves: its worker (the stand-in), the future map its spec-v2 branch resolves inputs through,
    and collaborators it only notifies (profiler, scripted hook, load reporting), as no-ops. DP attention is off, under
    both of its names (``enable_dp_attention`` before 0.5.22)."""
    import torch

    noop = lambda *args, **kwargs: None  # noqa: E731
    return dict(model_worker=model_worker, enable_pdmux=False, pp_group=NS(is_last_rank=True),
                scripted_scheduler_hook=None, forward_sleep_time=None,
                profiler_manager=NS(_profile_batch_predicate=noop), device_module=torch.cpu, attn_dp_enabled=False,
                enable_dp_attention=False,
                future_map=relay_future_map(spec_algorithm, req_to_token_pool))


def verify_commit_target(family, hf_config):
    """``batch -> target worker`` for ``commit_mamba_states_after_verify``: what it reads of the target worker (the
    model config, the request pool) and, as the attention backend, SGLang's own ``update_mamba_state_after_mtp_verify``
    bound to a stand-in holding what the method reads: the request pool and the batch's working mamba slots (its
    forward metadata's ``mamba_cache_indices``, the physical slots of ``get_mamba_indices``)."""
    update = _resolve(SPEC_V2["update_mamba_state_after_mtp_verify"])
    req_pool = family.sg_req_pool
    model_config = NS(hf_config=hf_config, linear_attn_registry_result=None, is_draft_model=False)

    def target(batch):
        slots = req_pool.translate_mamba_indices(req_pool.get_mamba_indices(batch.req_pool_indices))
        linear = NS(forward_metadata=NS(mamba_cache_indices=slots), req_to_token_pool=req_pool,
                    _translate_mamba_indices=req_pool.translate_mamba_indices, accept_lens_pool=None)
        backend = NS(linear_attn_backend=linear, _update_ple_state_after_mtp_verify=lambda *a, **k: None)
        backend.update_mamba_state_after_mtp_verify = update.__get__(backend)
        return NS(model_runner=NS(model_config=model_config, req_to_token_pool=req_pool, attn_backend=backend,
                                  model=None))

    return target
