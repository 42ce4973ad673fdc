"""What the family checks of the request pool SGLang's configurator built: rows over state slots, track slots."""

from __future__ import annotations


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
