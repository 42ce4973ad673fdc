"""Model-config strategies: the named built-in configs, and configs Hypothesis draws itself.

A drawn config covers what the eight named ones cannot: page sizes up to 64, windows from 1 to
past the pool, pools from one page up, long contexts past the 8192-token chunking of the backup
and reload paths, up to four layers of each kind in any interleaving, every KV and state dtype,
state shapes, and host pools of any size. Every choice shrinks toward the simplest config (page
size 1, the smallest sizes, the fewest layers, the blocked layout), so a failure is reported on
the smallest config that still fails.
"""

from __future__ import annotations

from typing import Callable

from hypothesis import strategies as st

from poolfuzz.pools.config import CONFIGS, KV_DTYPES, STATE_DTYPES, ModelConfig

DRAWN_NAME = "random"  # the name every drawn config carries (and --config random asks for)
PAGE_SIZES = (2, 4, 8, 16, 32, 64)
# A long context: past SGLang's 8192-position chunking of get_cpu_copy / load_cpu_copy. The
# machine draws prompts in units of max_context // 64 tokens, so its prompts run to 20480 tokens.
LONG_CONTEXT = 65536
LONG_POOL = LONG_CONTEXT  # a multiple of every page size
MAX_LAYERS = 4  # of each kind
# How the full-attention KV is stored, "plain" K and V rows first (what a draw shrinks to): SGLang's MLA and
# DSA pools (also between recurrent layers, Kimi-Linear's shape), MiniMax's sparse index caches, MHA with
# UE8M0 scale blocks, its CPU fp8 quantiser, and FP4 (MHA and MLA) with a scale row a token. A kind the
# drawn layers cannot hold (latent or quantised KV beside SWA layers, say) stays plain.
STORAGES = ("plain", "mla", "dsa", "msa", "fp8-scaled", "cpu-fp8", "fp4-mha", "fp4-mla")


def configs(names: list[str] | None = None) -> st.SearchStrategy[ModelConfig]:
    """One of the named built-in configs (all of them by default)."""
    chosen = names or sorted(CONFIGS)
    return st.sampled_from([CONFIGS[n] for n in chosen])


def _at_least(product_min: int, first: int) -> int:
    return -(-product_min // first)


@st.composite
def _state_shapes(draw):
    """Conv shapes (conv_dim, kernel-1) and the temporal shape, each of at least 12 values."""
    convs = []
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.integers(1, 4))
        convs.append((draw(st.integers(_at_least(12, k), 16)), k))
    heads = draw(st.integers(1, 4))
    head_dim = draw(st.integers(2, 8))
    state = draw(st.integers(_at_least(12, heads * head_dim), 8))
    return tuple(convs), (heads, head_dim, state)


@st.composite
def _drawn(draw) -> ModelConfig:
    # Every field is drawn whether or not the layers use it, in a fixed order, the layout last: the
    # shrinker can then drop a kind of layer without shifting every later draw (which would turn the
    # example into an unrelated one and stop the shrink at a needlessly large config).
    full = draw(st.integers(1, MAX_LAYERS))
    swa = draw(st.integers(0, MAX_LAYERS))
    mamba = draw(st.integers(0, MAX_LAYERS))
    ps = draw(st.one_of(st.just(1), st.sampled_from(PAGE_SIZES)))
    long = draw(st.integers(0, 4)) == 4  # one config in five, and it shrinks to a short one
    full_pages = draw(st.integers(1, max(1, 256 // ps)))  # from one page to many
    extra_context = draw(st.integers(0, 64))
    swa_pages = draw(st.integers(1, max(1, 256 // ps)))
    window = draw(st.one_of(st.integers(1, 16), st.integers(17, 1024)))  # 1 to past the pool
    head_num = draw(st.integers(1, 4))
    head_dim = draw(st.integers(_at_least(12, head_num), 16))
    kv_dtype = draw(st.sampled_from(KV_DTYPES))
    rows = draw(st.integers(1, 8))
    # host_pool backups: 0 is twice the full pool; a small host pool makes backups abort
    host_pages = draw(st.one_of(st.just(0), st.integers(1, 32)))
    mamba_slots = draw(st.integers(1, 8))
    conv, temporal = draw(_state_shapes())
    state_dtype = draw(st.sampled_from(STATE_DTYPES))
    # The modes of a recurrent-state model: extra-buffer track slots (1, or the overlap schedule's 2) and
    # speculative scratch for verifies of 2 to 5 tokens; both shrink to off
    track_slots = draw(st.sampled_from((0, 1, 2)))
    spec_tokens = draw(st.one_of(st.just(0), st.integers(2, 5)))
    storage = draw(st.sampled_from(STORAGES))
    blocked = "F" * full + "S" * swa + "M" * mamba
    pattern = ""
    if draw(st.booleans()):  # an interleaving; shrinks back to the blocked layout
        pattern = "".join(draw(st.permutations(list(blocked))))
        pattern = "" if pattern == blocked else pattern
    if long:
        full_tokens = swa_tokens = max_context = LONG_CONTEXT
    else:
        full_tokens, swa_tokens = ps * full_pages, ps * swa_pages
        # The engine, like the named configs, never lets a request outgrow its row: a request can
        # hold the whole full pool, so the context is at least the pool.
        max_context = max(2, full_tokens + extra_context)
    fields = dict(
        name=DRAWN_NAME, page_size=ps, full_layers=full, swa_layers=swa, mamba_layers=mamba,
        layer_pattern=pattern, head_num=head_num, head_dim=head_dim, kv_dtype=kv_dtype, full_tokens=full_tokens,
        max_context=max_context, request_rows=rows, host_tokens=host_pages * ps,
        # The architecture is what uses_ssm_state reads: it must agree with the layers built.
        architecture="qwen3-next" if mamba else ("gpt-oss" if swa else "llama"),
    )
    if swa:
        fields.update(sliding_window=window if window <= 16 else window * max(1, full_tokens // 256),
                      swa_tokens=swa_tokens)
    if mamba:
        fields.update(mamba_slots=mamba_slots, conv_shapes=conv, temporal_shape=temporal, state_dtype=state_dtype,
                      mamba_track_slots=track_slots, spec_draft_tokens=spec_tokens)
    fields.update(_storage_fields(storage, fields))
    return ModelConfig(**fields)


def _storage_fields(storage: str, f: dict) -> dict:
    """The fields of a storage kind, derived from what was drawn (no draw of its own, so choosing a kind never
    shifts the draws before it); {} where the drawn layers cannot hold that kind."""
    swa, mamba, full = f["swa_layers"], f["mamba_layers"], f["full_layers"]
    heads, head_dim = f["head_num"], f["head_dim"]
    if storage == "plain" or swa or (mamba and storage not in ("mla", "dsa")):
        return {}  # latent KV may sit beside recurrent layers (unquantised); every other kind: full layers only
    if storage in ("mla", "dsa"):
        latent = dict(attention=storage, kv_lora_rank=heads * head_dim, qk_rope_head_dim=max(12, head_dim))
        # DSA's index keys: 16-value scale blocks, three to six of them
        return latent | (dict(index_head_dim=16 * (2 + heads)) if storage == "dsa" else {})
    if storage == "msa":  # one letter per full layer (dense, index K+V, index K only), at least one sparse
        letters = "".join("DVK"[(head_dim + i) % 3] for i in range(full))
        return dict(attention="msa", msa_layers=letters if set(letters) & set("VK") else "V" + letters[1:],
                    index_head_dim=max(12, head_dim))
    if storage == "fp8-scaled":  # the smallest block that leaves a tag's 12 scales a row
        block = max(b for b in range(1, head_dim + 1) if head_dim % b == 0 and heads * head_dim // b >= 12)
        return dict(kv_dtype=f["kv_dtype"] if f["kv_dtype"].startswith("fp8") else "fp8_e4m3", kv_scale_block=block)
    if storage == "cpu-fp8":
        return dict(kv_dtype="fp8_e4m3", kv_quant="cpu_fp8_e4m3")
    if storage == "fp4-mha":  # packed pairs, a scale byte per 16 values, at least 12 scale bytes a token
        return dict(kv_quant="fp4_mx_block16", head_num=max(2, heads), head_dim=96)
    return dict(attention="mla", kv_quant="fp4_mx_block16", kv_lora_rank=32 * (4 + heads), qk_rope_head_dim=32)


def drawn_configs(*, faults=(), where: Callable[[ModelConfig], bool] | None = None) -> st.SearchStrategy[ModelConfig]:
    """Configs Hypothesis draws: only those every fault in ``faults`` applies to, and ``where`` accepts."""
    from poolfuzz.pools.faults import get_fault

    checks = [get_fault(f).applies_to for f in faults] + ([where] if where is not None else [])
    strategy = _drawn()
    return strategy.filter(lambda c: all(ok(c) for ok in checks)) if checks else strategy
