"""Model-config strategies: the named built-in configs, and configs Hypothesis draws itself.

A drawn config covers what the named ones cannot: page sizes up to 64, windows from 1 to past the
pool, pools from one page up, long contexts past the 8192-token chunking of the backup and reload
paths, up to four layers of each kind in any interleaving, every KV and state dtype, state shapes,
host pools of any size, every way the full-attention KV is stored (``STORAGES``), sliding-window and recurrent
state in separate layers or in the same ones (an Inkling's short convolutions), and the scheduling flags of the
server a scheduler-path family runs (policy, chunk size, conservativeness), and whether that server is sized by its
memory (SGLang then decides the sizes). Every choice
shrinks toward the simplest config (page size 1, the smallest sizes, the fewest layers, the blocked
layout), so a failure is reported on the smallest config that still fails. Faults that need a storage
kind steer the draw to it (``drawn_configs``).
"""

from __future__ import annotations

import itertools
from typing import Callable

from hypothesis import strategies as st

from poolfuzz.pools.config import CONFIGS, KV_DTYPES, SCHEDULE_POLICIES, STATE_DTYPES, ModelConfig
from poolfuzz.pools.errors import ConfigError

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
def _drawn(draw, storages: tuple[str, ...] = STORAGES, storage_decides_layers: bool = False) -> ModelConfig:
    # Every field is drawn whether or not the layers use it, in a fixed order, the layout last: the
    # shrinker can then drop a kind of layer without shifting every later draw (which would turn the
    # example into an unrelated one and stop the shrink at a needlessly large config).
    d = dict(
        full=draw(st.integers(1, MAX_LAYERS)),
        swa=draw(st.integers(0, MAX_LAYERS)),
        mamba=draw(st.integers(0, MAX_LAYERS)),
        ps=draw(st.one_of(st.just(1), st.sampled_from(PAGE_SIZES))),
        long=draw(st.integers(0, 4)) == 4,  # one config in five, and it shrinks to a short one
    )
    d.update(
        full_pages=draw(st.integers(1, max(1, 256 // d["ps"]))),  # from one page to many
        extra_context=draw(st.integers(0, 64)),
        swa_pages=draw(st.integers(1, max(1, 256 // d["ps"]))),
        window=draw(st.one_of(st.integers(1, 16), st.integers(17, 1024))),  # 1 to past the pool
        head_num=draw(st.integers(1, 4)),
    )
    d.update(
        head_dim=draw(st.integers(_at_least(12, d["head_num"]), 16)),
        kv_dtype=draw(st.sampled_from(KV_DTYPES)),
        rows=draw(st.integers(1, 8)),
        # host_pool backups: 0 is twice the full pool; a small host pool makes backups abort
        host_pages=draw(st.one_of(st.just(0), st.integers(1, 32))),
        mamba_slots=draw(st.integers(1, 8)),
        state_shapes=draw(_state_shapes()),
        state_dtype=draw(st.sampled_from(STATE_DTYPES)),
        # The modes of a recurrent-state model: extra-buffer track slots (1, or the overlap schedule's 2) and
        # speculative scratch for verifies of 2 to 5 tokens; both shrink to off
        track_slots=draw(st.sampled_from((0, 1, 2))),
        spec_tokens=draw(st.one_of(st.just(0), st.integers(2, 5))),
        storage=draw(st.sampled_from(storages)),
        # A scheduler-path server's scheduling flags (the pools path ignores them): its policy, its chunk size in
        # tokens a traffic unit (0: prompts are not chunked) and its conservativeness in hundredths; each shrinks to
        # the named configs' fcfs, 16 and 0.1
        policy=draw(st.sampled_from(SCHEDULE_POLICIES)),
        chunked=draw(st.sampled_from((16, 0, 4, 32))),
        conservativeness=draw(st.sampled_from((10, 30, 100))),
        # One server in four sized by its memory (4 to 64 KiB free once its weights are loaded: from a token to a few
        # thousand): SGLang decides its sizes, the drawn ones aside (``ModelConfig.free_memory_kib``); shrinks to caps
        sized_by_memory=draw(st.integers(0, 3)) == 3,
        memory_kib=draw(st.integers(4, 64)),
    )
    if storage_decides_layers:  # drop the layers the kind cannot sit beside, rather than the kind
        d.update(_layers_for(d["storage"], d["swa"], d["mamba"]))
    blocked = "F" * d["full"] + "S" * d["swa"] + "M" * d["mamba"]
    pattern = ""
    if draw(st.booleans()):  # an interleaving; shrinks back to the blocked layout
        pattern = "".join(draw(st.permutations(list(blocked))))
        pattern = "" if pattern == blocked else pattern
    # Sliding-window and recurrent layers together: an Inkling (its state in every attention layer) or not; drawn
    # last, so that it shifts no draw before it, and shrinks to state in layers of its own
    d["state_in_attention"] = draw(st.booleans())
    return _config_from(d, pattern)


def _layers_for(storage: str, swa: int, mamba: int) -> dict:
    """The SWA and recurrent layer counts a storage kind can be held beside: plain rows beside any, latent KV
    beside recurrent layers (unquantised), every other kind on full layers only."""
    if storage == "plain":
        return dict(swa=swa, mamba=mamba)
    return dict(swa=0, mamba=mamba if storage in ("mla", "dsa") else 0)


def _config_from(d: dict, pattern: str) -> ModelConfig:
    """The config of one set of drawn values (no draws here: ``_steering`` builds configs with it too)."""
    full, swa, mamba, ps = d["full"], d["swa"], d["mamba"], d["ps"]
    if d["long"]:
        full_tokens = swa_tokens = max_context = LONG_CONTEXT
    else:
        full_tokens, swa_tokens = ps * d["full_pages"], ps * d["swa_pages"]
        # The engine, like the named configs, never lets a request outgrow its row: a request can
        # hold the whole full pool, so the context is at least the pool.
        max_context = max(2, full_tokens + d["extra_context"])
    fields = dict(
        name=DRAWN_NAME, page_size=ps, full_layers=full, swa_layers=swa, mamba_layers=mamba,
        layer_pattern=pattern, head_num=d["head_num"], head_dim=d["head_dim"], kv_dtype=d["kv_dtype"],
        full_tokens=full_tokens, max_context=max_context, request_rows=d["rows"], host_tokens=d["host_pages"] * ps,
        # The architecture is what uses_ssm_state reads: it must agree with the layers built.
        architecture="qwen3-next" if mamba else ("gpt-oss" if swa else "llama"),
        schedule_policy=d["policy"], chunked_prefill=d["chunked"], conservativeness_pct=d["conservativeness"],
        # a long context's pool sized by memory would give it thousands of request rows' worth of tokens: named
        free_memory_kib=d["memory_kib"] if d["sized_by_memory"] and not d["long"] else 0,
    )
    if swa:
        window = d["window"]
        fields.update(sliding_window=window if window <= 16 else window * max(1, full_tokens // 256),
                      swa_tokens=swa_tokens)
    if mamba:
        conv, temporal = d["state_shapes"]
        fields.update(mamba_slots=d["mamba_slots"], conv_shapes=conv, temporal_shape=temporal,
                      state_dtype=d["state_dtype"], mamba_track_slots=d["track_slots"],
                      spec_draft_tokens=d["spec_tokens"])
    fields.update(_storage_fields(d["storage"], fields))  # none beside SWA layers: the same for an Inkling
    config = ModelConfig(**fields)
    # sliding-window and recurrent layers: the state in layers of their own, or in the attention layers as an Inkling
    # keeps it (``ModelConfig.with_state_in_attention``)
    return config.with_state_in_attention() if swa and mamba and d.get("state_in_attention") else config


def _storage_fields(storage: str, f: dict) -> dict:
    """The fields of a storage kind, derived from what was drawn (no draw of its own, so choosing a kind never
    shifts the draws before it); {} where the drawn layers cannot hold that kind."""
    swa, mamba, full = f["swa_layers"], f["mamba_layers"], f["full_layers"]
    heads, head_dim = f["head_num"], f["head_dim"]
    if storage == "plain" or _layers_for(storage, swa, mamba) != dict(swa=swa, mamba=mamba):
        return {}
    if storage in ("mla", "dsa"):
        latent = dict(attention=storage, kv_lora_rank=heads * head_dim, qk_rope_head_dim=max(12, head_dim))
        # DSA's index keys: 16-value scale blocks, three to six of them; at 64-token pages the shape SGLang's
        # indexer asserts (128 values), so the sglang family builds its DSA pool from a draw too
        index = 128 if f["page_size"] == 64 else 16 * (2 + heads)
        return latent | (dict(index_head_dim=index) if storage == "dsa" else {})
    if storage == "msa":  # one letter per full layer (dense, index K+V, index K only), at least one sparse
        letters = "".join("DVK"[(head_dim + i) % 3] for i in range(full))
        return dict(attention="msa", msa_layers=letters if set(letters) & set("VK") else "V" + letters[1:],
                    index_head_dim=max(12, head_dim))
    if storage == "fp8-scaled":  # the smallest block that leaves a tag's 12 scales a row
        block = max(b for b in range(1, head_dim + 1) if head_dim % b == 0 and heads * head_dim // b >= 12)
        return dict(kv_dtype="fp8_e4m3", kv_scale_block=block)  # MX FP8 elements are e4m3 (SGLang's mxfp8)
    if storage == "cpu-fp8":
        return dict(kv_dtype="fp8_e4m3", kv_quant="cpu_fp8_e4m3")
    if storage == "fp4-mha":  # packed pairs, a scale byte per 16 values, at least 12 scale bytes a token
        return dict(kv_quant="fp4_mx_block16", head_num=max(2, heads), head_dim=96)
    return dict(attention="mla", kv_quant="fp4_mx_block16", kv_lora_rank=32 * (4 + heads), qk_rope_head_dim=32)


def drawn_configs(*, faults=(), where: Callable[[ModelConfig], bool] | None = None,
                  shape: Callable[[ModelConfig], ModelConfig] | None = None) -> st.SearchStrategy[ModelConfig]:
    """Configs Hypothesis draws: each reshaped by ``shape`` (a family's ``model_shaped``: the layout and state widths
    of the model its engine serves), then only those every fault in ``faults`` applies to, and ``where`` accepts."""
    from poolfuzz.pools.faults import get_fault

    checks = [get_fault(f).applies_to for f in faults] + ([where] if where is not None else [])
    if shape is not None:  # not steered: a shaping family's checks are its engine's refusals, each a server built,
        return _drawn().map(shape).filter(lambda c: all(ok(c) for ok in checks))  # too costly to probe every kind
    if not checks:
        return _drawn()
    kinds = _steering(checks)
    # Plain rows accepted, or no probe passed (the checks want a mode or a size the probes lack): filter the
    # usual draw. Otherwise the checks want a storage kind, rare under the usual draw (FP4 on full layers
    # only: about one draw in a hundred, and Hypothesis gives a filter three tries): draw only the kinds they
    # accept, with the layers those kinds can be held beside.
    steer = kinds and "plain" not in kinds
    strategy = _drawn(storages=kinds, storage_decides_layers=True) if steer else _drawn()
    return strategy.filter(lambda c: all(ok(c) for ok in checks))


# Small configs, one per mix of layer kinds, that tell which storage kinds a set of checks can accept.
_PROBE = dict(ps=1, long=False, full_pages=16, extra_context=0, swa_pages=16, window=4, head_num=1, head_dim=12,
              kv_dtype=KV_DTYPES[0], rows=2, host_pages=0, mamba_slots=2, state_shapes=(((12, 1),), (1, 2, 6)),
              state_dtype=STATE_DTYPES[0], track_slots=0, spec_tokens=0, policy="fcfs", chunked=16, conservativeness=10,
              sized_by_memory=False, memory_kib=4)


def _steering(checks: list[Callable[[ModelConfig], bool]]) -> tuple[str, ...]:
    """The storage kinds for which some small config, with the layers the kind can be held beside, passes
    every check; page sizes and modes are left to the draw."""
    def accepts(kind: str) -> bool:
        # one and three full layers (MiniMax's layer letters cycle through three kinds); page sizes 1 and 64
        # (DSA's index layout differs at its production page size)
        for full, ps, (swa, mamba) in itertools.product((1, 3), (1, 64), ((0, 0), (1, 0), (0, 1), (1, 1))):
            values = _PROBE | dict(full=full, storage=kind, ps=ps, full_pages=max(1, 16 // ps))
            try:
                config = _config_from(values | _layers_for(kind, swa, mamba), "")
            except ConfigError:
                continue
            if all(ok(config) for ok in checks):
                return True
        return False

    return tuple(kind for kind in STORAGES if accepts(kind))
