"""The pools a release before 0.5.16 builds for a server: its model runner's own ``init_memory_pool``, run on a runner
that holds what the runner's ``__init__`` and ``initialize`` set before they call it.

What runs is SGLang's: the Scheduler's global ``ServerArgs`` (``set_global_server_args_for_scheduler``), the runner's
one-rank groups as its ``init_torch_distributed`` builds them (``init_distributed_environment`` on gloo,
``initialize_model_parallel``, ``initialize_dp_attention``), its ``configure_kv_cache_dtype``, its
``adjust_hybrid_swa_layers_for_pp`` where the release has it, and ``init_memory_pool`` with every method of the KV
cache mixin it calls: the free-memory profile, the mamba budget (``handle_max_mamba_cache``), the pool sizes (the
release's ``pool_configurator`` from 0.5.12), the running requests and the pool classes.

Stood in for, because the runner loads a model first: the model (no weights, no quantisation, no layer range: a
one-rank runner's is all the model's layers, ``initialize``'s ``max(num_hidden_layers, num_attention_layers)``), the
window ``load_model`` reads from it (``served_window``), and the free GPU memory the budget starts from
(``get_available_gpu_memory``, answered with the server's fixed budget as on the configurator path). A draft worker is
not built: no family runs a draft model (its target worker's pools, with their draft-token state, are).
"""

from __future__ import annotations

import contextlib
import types

from poolfuzz.adapters.sglang.compat.drift import marked_stand_in
from poolfuzz.adapters.sglang.compat import has_private, private, rank_standins_cleared, runner_state_unasked

NEEDS = ("model_runner", "runner_init_memory_pool", "runner_kv_dtype", "runner_free_memory",
         "init_distributed_environment", "initialize_model_parallel", "initialize_dp_attention")


def problem() -> str | None:
    """Why this release's model runner cannot build pools here, or None."""
    missing = [k for k in NEEDS if not has_private(k)]
    return f"its model runner's pool build needs what this release lacks: {', '.join(missing)}" if missing else None


@contextlib.contextmanager
def global_server(args):
    """``args`` as the Scheduler's global server arguments for the span of the build, the ones before put back (a
    scheduler path reads its own next). Where none were published, ``args`` stay: every scheduler path publishes its
    own before it reads them (``scheduling_global.publish``)."""
    from sglang.srt import server_args as module

    try:
        before = module.get_global_server_args()
    except (ValueError, AttributeError, RuntimeError):  # none published yet
        before = None
    module.set_global_server_args_for_scheduler(args)
    try:
        yield
    finally:
        if before is not None:
            module.set_global_server_args_for_scheduler(before)


_GROUPS: dict[str, object] = {}


def runner_groups(args, model_config, store: str) -> None:
    """A one-rank runner's process groups, as its ``init_torch_distributed`` builds them (on gloo: no GPU), once per
    process: the world and model-parallel groups, and the attention-parallel sizes from the first server's flags and
    model config (one rank's whatever they are). ``store``: a directory for the file store."""
    if "built" in _GROUPS:
        return
    import torch.distributed

    if not torch.distributed.is_initialized():
        private("init_distributed_environment")(backend="gloo", world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{store}/store")
    rank_standins_cleared()
    private("initialize_model_parallel")(tensor_model_parallel_size=1)
    private("initialize_dp_attention")(server_args=args, model_config=model_config)
    _GROUPS["built"] = True  # only once built: a failed first build leaves the next to try again


def served_window(model, model_config):
    """The window ``load_model`` sets on the runner from the loaded model: its class's own
    ``get_attention_sliding_window_size`` where it has one, else a hybrid SWA model config's window, else its
    attention chunk (a stand-in: ``load_model`` needs the weights)."""
    if hasattr(model, "get_attention_sliding_window_size"):
        return model.get_attention_sliding_window_size()
    if model_config.is_hybrid_swa and model_config.sliding_window_size is not None:
        return model_config.sliding_window_size
    return model_config.attention_chunk_size


def built_by_runner(args, model_config, model, device: str):
    """The model runner after ``init_memory_pool``: its ``req_to_token_pool``, ``token_to_kv_pool``,
    ``token_to_kv_pool_allocator`` and the sizes it settled on (``max_total_num_tokens``, ``max_running_requests``,
    a hybrid SWA model's ``full_`` and ``swa_max_total_num_tokens``). Called on the server's machine, its free memory
    fixed (``runner_calls.fixed_free_memory``), as the configurator path builds."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = marked_stand_in(object.__new__(private("model_runner")))  # no __init__: it would load the model
    layers = max(model_config.num_hidden_layers, model_config.num_attention_layers)
    # what ModelRunner.__init__ sets from its arguments (a one-rank target worker), and initialize before its pools
    runner.__dict__.update(
        mem_fraction_static=args.mem_fraction_static, memory_pool_config=None, device=device, gpu_id=0, tp_rank=0,
        tp_size=1, dcp_size=getattr(args, "dcp_size", 1), dcp_rank=0, moe_ep_rank=0, moe_ep_size=1, dp_rank=None,
        dp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=None, attn_cp_size=1, moe_dp_rank=None, moe_dp_size=1,
        model_config=model_config, server_args=args, is_draft_worker=False, draft_model_idx=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(args.speculative_algorithm), page_size=args.page_size,
        req_to_token_pool=None, token_to_kv_pool_allocator=None, is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=getattr(model_config, "is_hybrid_swa_compress", False),
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        enable_hisparse=getattr(args, "enable_hisparse", False), dflash_draft_num_layers=None, forward_stream=None,
        model=model, dtype=model_config.dtype, sliding_window_size=served_window(model, model_config),
        start_layer=0, end_layer=layers, num_effective_layers=layers, full_max_total_num_tokens=None,
        swa_max_total_num_tokens=None)
    runner_state_unasked(runner)
    from sglang.srt.distributed.parallel_state import get_pp_group

    runner.pp_group = get_pp_group()
    if hasattr(runner, "adjust_hybrid_swa_layers_for_pp"):  # 0.5.12 on: narrows the model config's SWA layer ids
        runner.adjust_hybrid_swa_layers_for_pp()
    runner.configure_kv_cache_dtype()
    runner.init_memory_pool(0)  # nothing held before the weights: the budget is the free memory
    return runner


def as_worker(runner):
    """The runner as the configurator path reads a worker's result, with the running requests it settled.

    0.5.9's ``init_memory_pool`` settles none: ``initialize`` sets them inline after it (nothing to call; the rest of
    ``initialize`` loads the model), to the smaller of ``--max-running-requests`` and the request pool's size. Stood in
    for by the request pool's size where the server names ``--max-running-requests`` (every server the adapter
    builds does), since that release's ``init_memory_pool`` never sizes the pool above the flag: the smaller is the
    pool's. None where the flag is unnamed: the running requests then follow the token slots, which only
    ``initialize`` reads, and a server sized by its memory is refused, saying so."""
    settled = vars(runner).get("max_running_requests")
    if settled is None and runner.server_args.max_running_requests is not None:
        settled = runner.req_to_token_pool.size
    return types.SimpleNamespace(
        req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        max_total_num_tokens=runner.max_total_num_tokens,
        max_running_requests=settled,
        full_max_total_num_tokens=runner.full_max_total_num_tokens,
        swa_max_total_num_tokens=runner.swa_max_total_num_tokens, sliding_window_size=runner.sliding_window_size)
