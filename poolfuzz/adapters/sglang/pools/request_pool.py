"""SGLang's request pool for a config: ``HybridReqToTokenPool`` with its MambaPool, in the config's modes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from poolfuzz.adapters.sglang.api import SGLangAPI, SGLangUnavailable, construct
from poolfuzz.pools.config import ModelConfig

STATE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_request_pool(api: SGLangAPI, c: ModelConfig, sdev: str):
    """SGLang's HybridReqToTokenPool for the config, in its modes (extra buffer, speculative caches): a throwaway one,
    on which ``speculative.speculative_problem`` asks whether this release builds the speculative caches here."""
    return construct(
        api.HybridReqToTokenPool, size=c.request_rows, mamba_size=c.mamba_slots,
        mamba_spec_state_size=c.request_rows, max_context_len=c.max_context, device=sdev,
        enable_memory_saver=False, cache_params=mamba_cache_params(api, c), mamba_layer_ids=list(c.mamba_layer_ids),
        speculative_num_draft_tokens=c.spec_draft_tokens or None, start_layer=0, **pool_kwargs(c),
        # EAGLE tree verify (top-k 2) keeps one dense conv window per draft step, which a step's tags
        # can live in; chain drafts on a GPU share window columns between steps (see speculative.py)
        speculative_eagle_topk=2 if c.spec_draft_tokens else None)


def mamba_cache_params(api: SGLangAPI, c: ModelConfig):
    """SGLang's Mamba2 cache params for the config's conv and temporal shapes and dtype."""
    conv = [tuple(s) for s in c.conv_shapes]
    heads, head_dim, state = c.temporal_shape
    conv_kernel = conv[0][-1] + 1
    shape = construct(api.Mamba2StateShape, conv=conv, temporal=tuple(c.temporal_shape),
                      intermediate_size=heads * head_dim, conv_dim=conv[0][0], ssm_state_size=state,
                      num_heads=heads, head_dim=head_dim, state_size=state, conv_kernel=conv_kernel)
    kwargs = dict(shape=shape, layers=list(c.mamba_layer_ids))
    if api.mamba2_state_dtype is not None:
        # as a model's config class asks them: the conv state in SGLang's own dtype (bfloat16 unless the server's
        # SGLANG_MAMBA_CONV_DTYPE names another), the temporal state in the model's mamba_ssm_dtype
        kwargs["dtype"] = api.mamba2_state_dtype(SimpleNamespace(mamba_ssm_dtype=c.state_dtype))
    elif api.Mamba2StateDType is not None:
        dtype = STATE_DTYPES[c.state_dtype]
        kwargs["dtype"] = construct(api.Mamba2StateDType, conv=dtype, temporal=dtype)
    try:
        return construct(api.Mamba2CacheParams, **kwargs)
    except TypeError as exc:
        raise SGLangUnavailable(f"cannot build Mamba2CacheParams on sglang {api.version}: {exc}") from exc


def pool_kwargs(config) -> dict:
    """The constructor flags of the config's mode: extra buffer on with track slots, the overlap
    schedule with two of them (SGLang's ``get_mamba_tracking_slots``)."""
    return dict(enable_mamba_extra_buffer=bool(config.mamba_track_slots),
                enable_overlap_schedule=config.mamba_track_slots == 2)


def rows_over_slots(pool) -> int:
    """The rows of a built request pool whose row -> state-slot table is shorter than its rows, else 0. 0.5.9 and
    0.5.10 size that table by the state slots, and their servers never build more rows than slots (the model runner
    caps the rows at ``max_mamba_cache_size // _calculate_mamba_ratio()``, a ratio of at least 1); a pool with more
    rows indexes past the table at its first admission, a state no server reaches."""
    mapping = getattr(pool, "req_index_to_mamba_index_mapping", None)
    return pool.size if mapping is not None and mapping.shape[0] < pool.size else 0


def check_built(pool, config) -> str | None:
    """The built pool allocates as many track slots per request as the config holds, or a reason."""
    if not config.mamba_track_slots:
        return None
    got = getattr(pool, "mamba_initial_tracking_slots", getattr(pool, "mamba_ping_pong_track_buffer_size", None))
    if got != config.mamba_track_slots:
        return (f"SGLang's pool gives each request {got} track slots in this mode, the config holds "
                f"{config.mamba_track_slots}")
    return None
