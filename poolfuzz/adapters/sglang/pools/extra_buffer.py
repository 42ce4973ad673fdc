"""Whether the release builds mamba extra-buffer mode: SGLang's ``HybridReqToTokenPool`` with
``enable_mamba_extra_buffer=True``, whose ``alloc`` gives a request its ping-pong track slots (the scheduler's
result processor then takes turns between them: ``get_mamba_ping_pong_other_idx``)."""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import parameters


def extra_buffer_problem(api, config) -> str | None:
    """Why this release cannot build the config's extra-buffer mode, or None (probes, never versions)."""
    if not config.mamba_track_slots:
        return None
    params = parameters(api.HybridReqToTokenPool)
    missing = [k for k in ("enable_mamba_extra_buffer", "enable_overlap_schedule") if k not in params]
    if missing or not hasattr(api.HybridReqToTokenPool, "get_mamba_ping_pong_other_idx"):
        return (f"SGLang {api.version}'s HybridReqToTokenPool has no ping-pong extra-buffer mode "
                f"({', '.join(missing) or 'get_mamba_ping_pong_other_idx'} missing)")
    return None
