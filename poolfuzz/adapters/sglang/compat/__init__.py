"""What the sglang families need of the installed SGLang, listed once, in one package: ``needs`` (where each
class lives across releases, which are needed, the private names read), ``scheduler`` (what the scheduler path reads
of a Scheduler built without its model), ``scheduler_global`` (the same on releases with one global ServerArgs),
``spec_v2`` (what a speculative round runs), ``platform`` (the GPU or CPU a server's flags are resolved on, stood in
for) and ``drift`` (which errors of a server's build or step are the adapter meeting a reshaped release: API
CHANGED).

Every engine-private name the adapter reads is read in this package and nowhere else; the rest of the adapter imports
it from here, as ``compat.NAME``."""

from __future__ import annotations

from poolfuzz.adapters.sglang.compat.needs import (  # noqa: F401
    ENGINE, NEEDS, release, engine_report, PRIVATE, CONV_WINDOW_PHYS, MAMBA_CHUNK_MEMO,
    private, has_private, private_module, private_name, conv_window_buffers, seed_mamba_chunk_size,
    registered_storage_backends, engine_report_needs, model_missing,
)
from poolfuzz.adapters.sglang.compat.scheduler import (  # noqa: F401
    SCHEDULER_MODULE, RESULT_PROCESSOR, TOKEN_RATIO, SCHEDULER_METHODS, scheduler_state, idle_compaction, published_extra_buffer,
    published_host_pool_backup, host_pools, host_tier_pools, wrapped_tree, resolve_decode_retraction_backup, publish_scheduler_context, SCHEDULE_FLAGS,
    result_processor, engine_invariant_problem, deferred_mamba_cow_and_clear, mamba_track_aligned_lens,
    batches_defer_mamba_cow, batch_rows, request_row, batch_prefill_inputs, physical_mamba_slots, queue_request,
    requests_owning_rows, req_to_token_headroom, token_ratio, has_retraction_backup_flag,
    memory_flags, namespace_published, published_namespace, worker_token_capacity, init_chunked_prefill, resolved_to_sglangs_own_model,
    relay_future_map,
)
from poolfuzz.adapters.sglang.compat.spec_v2 import (  # noqa: F401
    SPEC_V2, runs_spec_v2_synchronously, spec_v2_missing, spec_v2_modules, run_batch_state, verify_commit_target,
    verify_cache_locs, verify_result, torch_state_scatter,
)
from poolfuzz.adapters.sglang.compat.scheduler_global import (  # noqa: F401
    SCHEDULER_REPORTERS, GLOBAL_SCHEDULER_METHODS, SCHEDULER_INITS, MAMBA_STRATEGY_FLAGS, IDLE_METHODS, idle_method,
    IDLE_QUESTIONS, idle_question, fully_idle, idle_lacking, has_streaming_sessions, closed_sessions_deferred, session_opened, session_state, plans_with_context,
    global_scheduler_state, server_flags, release_flag_values, dcp_size, parser_refusal, single_tensor_parallel_rank,
    rank_standins_cleared, runner_state_unasked, has_tree_registry, scheduler_inits,
    retractions_reset, retractions_counted, invariant_checker, pool_stats, new_request, flush_pending_backups,
    publish_single_rank, RECEIVER_METADATA_METHODS, receiver_metadata_method, typed_state_items,
    transfer_args_kept,
    decode_names_one_state_item,
)
