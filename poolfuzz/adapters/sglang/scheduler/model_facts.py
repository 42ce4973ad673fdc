"""What a Scheduler built without its model is given of the model and the TpModelWorker, on either event loop: the
vocabulary, the model config fields the scheduling methods read, the request length cap, the tokens per layer, the
running requests, an empty batch."""

from __future__ import annotations

from poolfuzz.pools.config import ModelConfig

VOCAB = 1 << 15  # sampled tokens are below it; prompt tokens above it, so prompts share only the prefixes drawn
# A model with recurrent state: its HF config's mamba_chunk_size (the kernels' chunk; the checkpoint grid is this or the
# page size, the larger), small so that short prompts cross the chunks the extra buffer checkpoints at.
MAMBA_CHUNK = 4


def max_req_len(config: ModelConfig, pool_tokens: int) -> int:
    """The TpModelWorker's ``max_req_len``: ``min(context length, KV pool) - 1`` (its ``max_req_input_len`` is 5
    less)."""
    return min(config.max_context, pool_tokens) - 1


def tokens_per_layer(family) -> tuple[int | None, int | None]:
    """``(full, swa)`` tokens per layer as ``TpModelWorker.get_tokens_per_layer_info`` hands them to a hybrid SWA
    model's scheduler (``(None, None)`` for other models): its model runner's ``full_`` and
    ``swa_max_total_num_tokens``, the sizes SGLang's configurator chose when it built the pools (what the scheduler's
    idle check and its pool statistics count against)."""
    if not family.config.has_swa:
        return None, None
    sizes = family.served.sizes
    return sizes["full_max_total_num_tokens"], sizes["swa_max_total_num_tokens"]


def worker_max_running(family) -> int:
    """The running requests the TpModelWorker reports to its Scheduler (``init_model_worker`` reads them off it):
    what SGLang's configurator (before 0.5.16 its model runner) settled for the pools it built, not the flag asked."""
    return family.served.sizes["max_running_requests"]


def model_config_standin(config: ModelConfig):
    """The model config fields the scheduling methods read (the real one is built from a model's HF config)."""
    from types import SimpleNamespace

    # hf_text_config: the model's HF config, as far as the scheduler reads it
    return SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False, context_len=config.max_context,
                           self_opened_think_start_ids=None, think_end_ids=None, think_end_id=None,
                           is_multimodal=False, hf_eos_token_id=set(), is_hybrid_swa=config.has_swa,
                           is_matryoshka=False, is_generation=True, use_ngram_embedding=False,
                           hf_text_config=SimpleNamespace(mamba_chunk_size=MAMBA_CHUNK))


def schedule_batch_class():
    """SGLang's ``ScheduleBatch``."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    return ScheduleBatch


def empty_batch():
    """The running batch a Scheduler starts with (``init_running_status``): no requests, not full."""
    return schedule_batch_class()(reqs=[], batch_is_full=False)
