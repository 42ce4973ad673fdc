"""Pools in a listing's words (``poolfuzz configs``)."""

from __future__ import annotations

# The listing's name of a speculative server's draft worker's KV pool, which no family's pools are compared with.
DRAFT = "draft KV pool"


def describe_pools(req_to_token_pool, token_to_kv_pool, allocator) -> dict[str, str]:
    """Each pool and each part of a hybrid one: its class, size, and the shapes and layers that tell two builds apart
    (the configurator's and the family's alike)."""
    rows = getattr(req_to_token_pool, "req_to_token", None)
    out = {"request pool": type(req_to_token_pool).__name__ + (f" ({rows.shape[0]} rows of {rows.shape[1]} tokens)"
                                                                if rows is not None else "")}
    mamba = getattr(req_to_token_pool, "mamba_pool", None)
    if mamba is not None:
        cache = mamba.mamba_cache
        conv = ", ".join(str(tuple(t.shape[2:])) for t in cache.conv) + f" {cache.conv[0].dtype}"
        spec = getattr(cache, "intermediate_ssm", None)  # a speculative server's per-draft-token states
        out["mamba pool"] = (f"{type(mamba).__name__} ({mamba.size} slots; conv {conv}; "
                             f"temporal {tuple(cache.temporal.shape[2:])} {cache.temporal.dtype}"
                             + (f"; {spec.shape[2]} draft-token states for {spec.shape[1]} requests"
                                if spec is not None else "") + ")")
    out["KV pool"] = kv_pool_words(token_to_kv_pool)
    for part in ("full_kv_pool", "swa_kv_pool", "main_pool", "index_kv_pool", "index_k_pool"):
        sub = getattr(token_to_kv_pool, part, None)
        if sub is not None:
            out[part.replace("_", " ")] = f"{type(sub).__name__} ({sub.size} tokens, {getattr(sub, 'dtype', '?')})"
    out["allocator"] = f"{type(allocator).__name__} ({allocator.size} tokens)"
    return out


def kv_pool_words(pool) -> str:
    """A KV pool's class, size, dtype, quantisation and (for a hybrid one) its layers, in a listing's words."""
    quant = type(getattr(pool, "quant_method", None)).__name__
    layers = ""
    mapping = getattr(pool, "layers_mapping", None)
    if isinstance(mapping, dict) and mapping:
        layers = "; sliding-window layers " + str(sorted(i for i, (_, swa) in mapping.items() if swa))
    full_ids = getattr(pool, "full_attention_layer_id_mapping", None)  # a hybrid linear pool's
    if not layers and isinstance(full_ids, dict):
        layers = f"; attention layers {sorted(full_ids)}"
    return (f"{type(pool).__name__} ({pool.size} tokens, {getattr(pool, 'dtype', '?')}"
            + (f", {quant}" if quant not in ("NoneType", "UnquantizedKVCacheMethod") else "") + layers + ")")
