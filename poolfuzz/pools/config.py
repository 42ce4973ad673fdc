"""Model configs: the layer mix and pool sizes a family is built from, and the shared SSM predicate."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from poolfuzz.pools.attention_kinds import ATTENTIONS, KINDS
from poolfuzz.pools.errors import ConfigError

# Model architectures whose layers keep recurrent (conv / temporal) state besides attention KV.
# This is poolfuzz's analogue of SGLang's ``uses_ssm_state``: a new SSM architecture that is
# forgotten here silently takes the lossy retraction path. The harness audits this predicate
# against the layers a built family really has.
SSM_ARCHITECTURES = frozenset(
    {"qwen3-next", "mamba2", "nemotron-h", "kimi-linear", "glm5-next", "lightning", "inkling", "falcon-h1"}
)

KV_DTYPES = ("bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2")
# How full-attention KV is stored (``attention``): per-head K and V (MHA); one latent row per token, the compressed
# KV then the rope part (MLA, SGLang's MLATokenToKVPool); MLA plus the DSA indexer's keys and scales in a page-major
# cache of their own (SGLang's DSATokenToKVPool, earlier NSATokenToKVPool); MiniMax sparse attention (SGLang's
# MiniMaxSparseKVPool). What each kind needs and is built with: ``attention_kinds.KINDS``.
STATE_DTYPES = ("bfloat16", "float16", "float32")
# A scheduler-path server's --schedule-policy: SGLang's policies that every release it drives has and that decide
# without a clock or a random draw (``hrrn`` ages requests by wall time, ``random`` shuffles): FCFS and LOF order the
# waiting queue by arrival and by output length; LPM and DFS-weight match every waiting prompt in the radix tree.
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")
# Where a model's recurrent state lives (``ModelConfig.recurrent_layers``): in layers of its own, or in every
# attention layer beside its KV (Inkling's short convolutions).
RECURRENT_LAYERS = ("own", "attention")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of one model as its memory pools see it. Sizes are small so CPU tests reuse slots fast."""

    name: str
    architecture: str  # read by uses_ssm_state; the layer counts below say what the family builds
    page_size: int = 1
    full_layers: int = 1  # full-attention layers
    swa_layers: int = 0  # sliding-window attention layers
    mamba_layers: int = 0  # recurrent-state (mamba / GDN / short-conv) layers
    # Where the recurrent state lives: "own", in layers of their own (the M of ``layer_pattern``); "attention", in
    # every attention layer beside its KV, as Inkling's short convolutions keep theirs (SGLang's MambaPool's layers are
    # then the attention layers, ``mamba_layers`` of them, and the state may be conv windows only: ``temporal_shape``
    # (0, 0, 0), as Inkling's has no temporal state)
    recurrent_layers: str = "own"
    sliding_window: int = 0  # tokens; required when swa_layers > 0
    head_num: int = 2
    head_dim: int = 8
    kv_dtype: str = "bfloat16"
    full_tokens: int = 64  # full-attention KV token slots (a multiple of page_size)
    swa_tokens: int = 0  # sliding-window KV token slots (a multiple of page_size)
    request_rows: int = 6
    max_context: int = 64
    mamba_slots: int = 0
    # per conv tensor, as the model's pool lays it out: (conv_dim, kernel-1), or kernel-major for Kimi-Linear
    conv_shapes: tuple[tuple[int, ...], ...] = ((6, 3),)
    temporal_shape: tuple[int, int, int] = (2, 4, 4)  # (heads, head_dim, state_size)
    state_dtype: str = "float32"
    host_tokens: int = 0  # host (CPU) pool slots for host_pool retraction backup; 0 = derived
    # One letter per layer, in model order: F full attention, S sliding window, M mamba. Empty: the
    # full layers first, then the SWA layers, then the mamba ones (the named configs' layout).
    layer_pattern: str = ""
    attention: str = "mha"  # one of ATTENTIONS
    kv_lora_rank: int = 16  # MLA / DSA: the compressed-KV part of a latent row
    qk_rope_head_dim: int = 16  # MLA / DSA: the rope part of a latent row
    index_head_dim: int = 48  # DSA: index-key bytes per token (fp8), with a float32 scale per DSA_QUANT_BLOCK
    # MHA with kv_dtype fp8_e4m3: 0 for none, else one UE8M0 scale byte per this many values of K and
    # of V, kept in scale buffers beside them (SGLang's MHATokenToKVPoolMXFP8: 32)
    kv_scale_block: int = 0
    # Mamba extra-buffer mode: track slots each request holds beside its state slot, from the same
    # allocator, into which the forward also writes the state (for the prefix cache to keep). 0: off;
    # 1: one track slot; 2: the overlap schedule's ping-pong pair (SGLang's get_mamba_tracking_slots)
    mamba_track_slots: int = 0
    # Speculative decoding (MTP / EAGLE, one chain of drafts): the tokens one verify forward checks,
    # the last sampled token plus the drafts (SGLang's speculative_num_draft_tokens). The recurrent
    # state after each of them lands in the request's scratch row (MambaPool's intermediate ssm and
    # conv-window caches, one row per request row), and the commit copies the last accepted one's
    # into the state slot. 0: off (a speculative step then folds the accepted tokens directly).
    spec_draft_tokens: int = 0
    # How KV is quantised: "" for not at all; "cpu_fp8_e4m3", SGLang's CPU fp8 KV cache (an MHA pool built
    # with that ``quant_method``, whose write door quantises the model's K and V into the fp8 buffers,
    # ``pools.quantised``; attention "mha", kv_dtype fp8_e4m3); "fp4_mx_block16", SGLang's FP4 KV cache: packed
    # 4-bit rows and a scale byte per 16 values (attention "mla": ``MLATokenToKVPoolFP4``, ``pools.latent_fp4``;
    # attention "mha": ``pools.mha_fp4``). Full-attention models only.
    kv_quant: str = ""
    # MiniMax sparse attention (attention "msa"): one letter per full-attention layer, in order: D dense,
    # V sparse with an index key and value per token (SGLang's index_kv_pool), K sparse with an index key
    # only (its index_k_pool: the layers of ``sparse_disable_index_value``). Index rows: index_head_dim values.
    msa_layers: str = ""
    # The scheduling flags of the server a scheduler-path family runs (the pools path has no scheduler and ignores
    # them; the pool sizes above are that server's size flags): --schedule-policy; --chunked-prefill-size in tokens
    # per ``traffic_unit``, rounded up to whole pages (0: --chunked-prefill-size -1, prompts prefilled whole); and
    # --schedule-conservativeness in hundredths, below SGLang's 1.0 so that decode runs out of slots and retracts.
    schedule_policy: str = "fcfs"
    chunked_prefill: int = 16
    conservativeness_pct: int = 10
    # A server sized by its memory, as most are launched: the device memory (KiB) its KV cache configurator finds
    # free once the weights are loaded, from which SGLang itself decides the token slots, the window pool's share
    # (at its default --swa-full-tokens-ratio), the mamba slots and the running requests it can hold, no cap named
    # but --max-running-requests (``request_rows``). The sizes above are then read back from what it built (the
    # sglang family's ``configurator.server_sized``; a family that sizes nothing itself takes them as given).
    # 0: the server names the sizes above as its caps.
    free_memory_kib: int = 0

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ConfigError(f"config {self.name!r} is impossible: " + "; ".join(problems))

    @property
    def latent(self) -> bool:
        """Full attention stored as MLA latent rows (MLA and DSA)."""
        return KINDS[self.attention].latent

    @property
    def traffic_unit(self) -> int:
        """Tokens per drawn prompt or chunk length: ``max_context // 64``, so a long-context config gets prompts of
        thousands of tokens (and 64-token pages fill) while the named configs (contexts <= 64) draw token by token.
        A server's chunked prefill is scaled by it too (a prompt is chunked in the same few pieces)."""
        return max(1, self.max_context // 64)

    def msa_layer_ids(self, kind: str) -> tuple[int, ...]:
        """The full-attention layers of one MiniMax kind: "D" dense, "V" index K and V, "K" index K only."""
        return tuple(lid for lid, k in zip(self.full_layer_ids, self.msa_layers) if k == kind)

    @property
    def has_swa(self) -> bool:
        return self.swa_layers > 0

    @property
    def has_full(self) -> bool:
        """Full-attention KV of its own; False for an all-SWA model, whose token slots are the window's."""
        return self.full_layers > 0

    @property
    def has_mamba(self) -> bool:
        return self.mamba_layers > 0

    @property
    def state_in_attention(self) -> bool:
        """The recurrent state lives in the attention layers (``recurrent_layers`` "attention"), not in its own."""
        return self.recurrent_layers == "attention"

    @property
    def own_mamba_layers(self) -> int:
        """The layers that hold recurrent state and nothing else (none where the attention layers hold it)."""
        return 0 if self.state_in_attention else self.mamba_layers

    @property
    def has_temporal(self) -> bool:
        """The recurrent state has a temporal part (Inkling's short convolutions keep conv windows only)."""
        return tuple(self.temporal_shape) != (0, 0, 0)

    @property
    def num_layers(self) -> int:
        return self.full_layers + self.swa_layers + self.own_mamba_layers

    @property
    def layers(self) -> str:
        """The layer kinds in model order (``layer_pattern``, or the blocked layout it defaults to)."""
        return self.layer_pattern or "F" * self.full_layers + "S" * self.swa_layers + "M" * self.own_mamba_layers

    def _ids(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layers) if k == kind)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return self._ids("F")

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return self._ids("S")

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """The layers whose recurrent state the mamba pool holds: the M layers, or every attention layer."""
        return tuple(range(self.num_layers)) if self.state_in_attention else self._ids("M")

    @property
    def host_size(self) -> int:
        """Host pool slots: as configured, else twice the full pool, rounded up to whole pages."""
        size = self.host_tokens or 2 * self.full_tokens
        ps = self.page_size
        return -(-size // ps) * ps

    def device_capacity(self) -> dict[str, int]:
        """Free units of each device space of a fresh family: rows, mamba slots, token slots."""
        out = {"rows": self.request_rows}
        if self.has_full:
            out["full"] = self.full_tokens
        if self.has_swa:
            out["swa"] = self.swa_tokens
        if self.has_mamba:
            out["mamba"] = self.mamba_slots
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_state_in_attention(self) -> "ModelConfig":
        """This model with its recurrent state beside every attention layer's KV, as an Inkling keeps it, not in
        layers of its own (dropped from the pattern): six short convs of its first conv's kernel, kernel-major, over
        the KV width twice, the window layers' KV width twice and the hidden width twice (here all one width, the
        heads times the head dim), in bfloat16 (Inkling's state dtype, whatever the model's), no temporal state and
        no draft-token states. On a config whose state is there already: its convs over its heads' width again."""
        width = self.head_num * self.head_dim
        kernel = self.conv_shapes[0][0] if self.state_in_attention else self.conv_shapes[0][1]  # kernel-major, or not
        return self.replace(architecture="inkling", recurrent_layers="attention",
                            mamba_layers=self.full_layers + self.swa_layers,
                            layer_pattern=self.layer_pattern.replace("M", ""),
                            conv_shapes=((kernel, width),) * 6, temporal_shape=(0, 0, 0),
                            state_dtype="bfloat16", spec_draft_tokens=0)


def _validate(c: ModelConfig) -> list[str]:
    problems = []
    if c.page_size < 1:
        problems.append(f"page_size must be >= 1, got {c.page_size}")
    if c.full_layers < 0:
        problems.append("full_layers cannot be negative")
    elif c.full_layers == 0:
        problems += _validate_all_swa(c)
    if c.swa_layers < 0 or c.mamba_layers < 0:
        problems.append("layer counts cannot be negative")
    if c.kv_dtype not in KV_DTYPES:
        problems.append(f"kv_dtype {c.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if c.state_dtype not in STATE_DTYPES:
        problems.append(f"state_dtype {c.state_dtype!r} is not one of {', '.join(STATE_DTYPES)}")
    if c.page_size >= 1:
        if c.full_layers and (c.full_tokens < c.page_size or c.full_tokens % c.page_size):
            problems.append(
                f"full_tokens ({c.full_tokens}) must be a positive multiple of page_size ({c.page_size})"
            )
        if c.swa_layers and (c.swa_tokens < c.page_size or c.swa_tokens % c.page_size):
            problems.append(
                f"swa_tokens ({c.swa_tokens}) must be a positive multiple of page_size ({c.page_size})"
            )
    if c.swa_layers and c.sliding_window < 1:
        problems.append("swa_layers > 0 needs sliding_window >= 1")
    if not c.swa_layers and (c.swa_tokens or c.sliding_window):
        problems.append("swa_tokens / sliding_window are set but swa_layers is 0")
    if c.mamba_track_slots and (not c.mamba_layers or c.mamba_track_slots not in (1, 2)):
        problems.append(f"mamba_track_slots ({c.mamba_track_slots}) must be 1 or 2 (extra-buffer mode, 2 with the "
                        "overlap schedule) and needs mamba_layers > 0")
    if c.spec_draft_tokens and (not c.mamba_layers or c.spec_draft_tokens < 2):
        problems.append(f"spec_draft_tokens ({c.spec_draft_tokens}) must be at least 2 (the last token and one "
                        "draft) and needs mamba_layers > 0 (the intermediate state caches are the MambaPool's)")
    if c.schedule_policy not in SCHEDULE_POLICIES:
        problems.append(f"schedule_policy {c.schedule_policy!r} is not one of {', '.join(SCHEDULE_POLICIES)}")
    if c.free_memory_kib < 0:
        problems.append(f"free_memory_kib ({c.free_memory_kib}) must be >= 0 (0: the sizes are the server's caps)")
    if c.chunked_prefill < 0:
        problems.append(f"chunked_prefill ({c.chunked_prefill}) must be >= 0 (0: prompts are not chunked)")
    if not 1 <= c.conservativeness_pct <= 1000:
        problems.append(f"conservativeness_pct ({c.conservativeness_pct}) must be from 1 to 1000 (hundredths of "
                        "--schedule-conservativeness)")
    if c.mamba_layers and c.mamba_slots < 1:
        problems.append("mamba_layers > 0 needs mamba_slots >= 1")
    if not c.mamba_layers and c.mamba_slots:
        problems.append("mamba_slots is set but mamba_layers is 0")
    if c.layer_pattern:
        if set(c.layer_pattern) - set("FSM"):
            problems.append(f"layer_pattern {c.layer_pattern!r} may hold only F (full), S (swa) and M (mamba)")
        counts = (c.layer_pattern.count("F"), c.layer_pattern.count("S"), c.layer_pattern.count("M"))
        if counts != (c.full_layers, c.swa_layers, c.own_mamba_layers):
            problems.append(f"layer_pattern {c.layer_pattern!r} has {counts[0]} F, {counts[1]} S, {counts[2]} M "
                            f"but the config has full_layers={c.full_layers}, swa_layers={c.swa_layers}, "
                            f"mamba_layers={c.own_mamba_layers}" + (" of their own" if c.state_in_attention else ""))
    problems += _validate_storage(c)
    if c.request_rows < 1:
        problems.append("request_rows must be >= 1")
    if c.max_context < 2:
        problems.append("max_context must be >= 2")
    # Rows carry a traceable tag of 12 values; smaller rows cannot say whose data they hold.
    if c.head_num * c.head_dim < 12:
        problems.append(f"head_num*head_dim must be >= 12 (got {c.head_num * c.head_dim})")
    if c.mamba_layers:
        for shape in c.conv_shapes:
            if _prod(shape) < 12:
                problems.append(f"conv shape {shape} holds fewer than 12 values")
        if _prod(c.temporal_shape) < 12 and not (c.state_in_attention and not c.has_temporal):
            problems.append(f"temporal shape {c.temporal_shape} holds fewer than 12 values (only state kept in the "
                            "attention layers may have none: (0, 0, 0))")
    problems += _validate_recurrent_layers(c)
    return problems


def _validate_recurrent_layers(c: ModelConfig) -> list[str]:
    """Where the recurrent state lives: its own layers, or every attention layer (Inkling's short convolutions)."""
    if c.recurrent_layers not in RECURRENT_LAYERS:
        return [f"recurrent_layers {c.recurrent_layers!r} is not one of {', '.join(RECURRENT_LAYERS)}"]
    attention = c.full_layers + c.swa_layers
    if c.state_in_attention and c.mamba_layers != attention:
        return [f"recurrent_layers 'attention' keeps state in every attention layer: mamba_layers must be "
                f"{attention} (full_layers + swa_layers), got {c.mamba_layers}"]
    return []


def _validate_all_swa(c: ModelConfig) -> list[str]:
    """A model without full attention: every layer sliding-window (SGLang's PureSWATokenToKVPoolAllocator,
    which asserts page size 1, and its PureSWARadixCache)."""
    kind = KINDS.get(c.attention)
    if not c.swa_layers or c.mamba_layers or kind is None or not kind.sliding_window or c.kv_scale_block:
        return ["full_layers must be >= 1 unless every layer is sliding-window (an all-SWA model: swa_layers > 0, "
                "no mamba layers, attention 'mha', no scale blocks)"]
    problems = []
    if c.page_size != 1:
        problems.append(f"an all-SWA model (full_layers = 0) needs page_size 1, got {c.page_size} "
                        "(SGLang's PureSWATokenToKVPoolAllocator allocates single slots)")
    if c.full_tokens:
        problems.append(f"an all-SWA model (full_layers = 0) has no full KV pool: set full_tokens = 0, "
                        f"got {c.full_tokens}")
    return problems


def _validate_storage(c: ModelConfig) -> list[str]:
    """The attention storage fields: MLA / DSA row parts, DSA index keys, MHA scale blocks."""
    problems = []
    if c.attention not in ATTENTIONS:
        return [f"attention {c.attention!r} is not one of {', '.join(ATTENTIONS)}"]
    kind = KINDS[c.attention]
    problems += kind.rules(c)
    if c.msa_layers and c.attention != "msa":
        problems.append(f"msa_layers is set but attention is {c.attention!r}; set attention = 'msa'")
    if c.kv_quant and (c.kv_quant not in ("cpu_fp8_e4m3", "fp4_mx_block16") or c.kv_scale_block or c.has_swa
                       or c.has_mamba):
        problems.append(f"kv_quant {c.kv_quant!r} must be 'cpu_fp8_e4m3' or 'fp4_mx_block16', with no "
                        "kv_scale_block and full-attention layers only")
    elif c.kv_quant and c.kv_quant not in kind.kv_quants:
        takes = " or ".join(repr(k.name) for k in KINDS.values() if c.kv_quant in k.kv_quants)
        problems.append(f"kv_quant {c.kv_quant!r} needs attention {takes}")
    elif c.kv_quant == "cpu_fp8_e4m3" and c.kv_dtype != "fp8_e4m3":
        problems.append("kv_quant 'cpu_fp8_e4m3' needs kv_dtype 'fp8_e4m3'")
    if c.kv_scale_block:
        if not kind.scale_blocks or c.kv_dtype != "fp8_e4m3" or c.has_swa or c.has_mamba:
            problems.append("kv_scale_block needs attention 'mha', kv_dtype 'fp8_e4m3' (MX FP8's element type: "
                            "SGLang's --kv-cache-dtype mxfp8 builds e4m3 whatever else is asked) and full-attention "
                            "layers only (the built-in SWA and hybrid pools carry no scale buffers)")
        elif c.kv_scale_block < 1 or c.head_dim % c.kv_scale_block:
            problems.append(f"kv_scale_block ({c.kv_scale_block}) must divide head_dim ({c.head_dim})")
        elif c.head_num * c.head_dim // c.kv_scale_block < 12:
            problems.append(f"head_num*head_dim/kv_scale_block must be >= 12 (each scale row carries a tag), "
                            f"got {c.head_num * c.head_dim // c.kv_scale_block}")
    return problems


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def uses_ssm_state(config: ModelConfig) -> bool:
    """Does this model keep recurrent state besides attention KV? Shared by every backup decision."""
    return config.architecture in SSM_ARCHITECTURES


def _base_configs() -> list[ModelConfig]:
    dense = ModelConfig(
        name="dense", architecture="llama", full_layers=2, full_tokens=48, request_rows=5,
        max_context=48, kv_dtype="bfloat16",
    )
    swa = ModelConfig(
        name="swa", architecture="gpt-oss", full_layers=1, swa_layers=2, sliding_window=6,
        full_tokens=64, swa_tokens=32, request_rows=5, max_context=64, kv_dtype="float16",
    )
    # Shaped as SGLang builds a Qwen3-Next (server_models): its full-attention layer the last of its interval, one
    # short conv a recurrent layer over the query and key widths (4 each) and the value width (8), so that its servers run on
    # the pools SGLang's own configurator builds (issue 35)
    hybrid = ModelConfig(
        name="hybrid-linear", architecture="qwen3-next", full_layers=1, mamba_layers=2,
        mamba_slots=4, full_tokens=48, request_rows=5, max_context=48, kv_dtype="bfloat16",
        state_dtype="float32", layer_pattern="MMF", conv_shapes=((16, 3),),
    )
    # Shaped as SGLang builds an Inkling (server_models): sliding-window and full attention, each layer keeping its
    # short convolutions' windows beside its KV (kernel-major: kernel - 1 by the full and the window layers' KV width
    # and the hidden width, two of each) and no temporal state; SWA and recurrent state in one model, #35957's kind
    swa_ssm = ModelConfig(
        name="swa-ssm", architecture="inkling", full_layers=1, swa_layers=1, mamba_layers=2,
        recurrent_layers="attention", conv_shapes=((3, 16),) * 6, temporal_shape=(0, 0, 0),
        sliding_window=6, mamba_slots=4, full_tokens=48, swa_tokens=32, request_rows=5,
        max_context=64, kv_dtype="bfloat16", state_dtype="bfloat16",
    )
    return [dense, swa, hybrid, swa_ssm]


def _storage_configs() -> list[ModelConfig]:
    """Full-attention models whose KV is stored other than as plain K and V rows."""
    mla = ModelConfig(name="mla", architecture="deepseek-v3", attention="mla", full_layers=2, full_tokens=48,
                      request_rows=5, max_context=48, kv_dtype="bfloat16")
    dsa = mla.replace(name="dsa", architecture="deepseek-v3.2", attention="dsa")
    dense = _base_configs()[0]
    # MX block scaling as SGLang's MHATokenToKVPoolMXFP8 stores it: a UE8M0 scale per 32 values (the MX
    # block), 128-value heads; three heads give the 12 scales a row that carry a tag
    scaled = ModelConfig(name="fp8-scaled", architecture="llama", full_layers=2, full_tokens=48, request_rows=5,
                         max_context=48, kv_dtype="fp8_e4m3", head_num=3, head_dim=128, kv_scale_block=32)
    # SGLang's CPU fp8 KV cache (``--kv-cache-dtype fp8_e4m3`` on its CPU engine): the quantising write door
    cpu_fp8 = dense.replace(name="dense-cpu-fp8", kv_dtype="fp8_e4m3", kv_quant="cpu_fp8_e4m3")
    # DeepSeek with ``--kv-cache-dtype fp4_e2m1``: SGLang's MLATokenToKVPoolFP4
    mla_fp4 = mla.replace(name="mla-fp4", kv_quant="fp4_mx_block16", kv_lora_rank=160, qk_rope_head_dim=32)
    # MiniMax M3 (SGLang's MiniMaxSparseKVPool): a dense layer, then sparse layers whose indexer keeps keys and
    # values (V) or keys only (K: ``sparse_disable_index_value``); index rows of one 16-value head
    msa = dense.replace(name="minimax-sparse", architecture="minimax-m3", attention="msa", full_layers=4,
                        msa_layers="DVKV", index_head_dim=16)
    # ... and a model whose sparse layers all keep index keys only: the shape SGLang's PD and HiCache take
    msa_konly = msa.replace(name="minimax-sparse-konly", msa_layers="DKDK")
    # An MHA model with ``--kv-cache-dtype fp4_mx_block16``: packed K and V, a scale row each (12 bytes a token)
    dense_fp4 = dense.replace(name="dense-fp4", kv_quant="fp4_mx_block16", head_num=2, head_dim=96)
    return [mla, dsa, scaled, cpu_fp8, mla_fp4, msa, msa_konly, dense_fp4]


def _hybrid_storage_configs() -> list[ModelConfig]:
    """Recurrent models whose full-attention KV is stored other than as K and V rows: Kimi-Linear's MLA
    layers between its KDA (linear-attention) layers, SGLang's HybridLinearKVPool with an MLA sub-pool.
    The full layers are not the first ones, so the pool maps model layer ids to its sub-pool's. Blocked, as every
    named config is (Kimi-Linear interleaves three KDA layers a MLA one: drawn layouts reach that). The KDA conv state
    is the one SGLang's ``KimiLinearStateShape`` lays out: kernel-major, the query, key and value widths (8 each, the
    temporal state's 2 heads of 4) side by side, so that its servers run on the configurator's pools (issue 35)."""
    return [ModelConfig(name="mla-ssm", architecture="kimi-linear", attention="mla", full_layers=2, mamba_layers=2,
                        layer_pattern="MMFF", mamba_slots=4, full_tokens=48, request_rows=5, max_context=48,
                        kv_dtype="bfloat16", state_dtype="float32", conv_shapes=((3, 24),))]


def _dsa_ssm_ps64(mla_ssm: ModelConfig) -> ModelConfig:
    """DSA layers between recurrent ones, as a GLM-5 Next lays them out (SGLang's HybridLinearKVPool with use_dsa:
    the DSA sub-pool keeps its index cache, which PD sends as the DSA state after the MAMBA one), in the shape SGLang's
    indexer takes, its latent rows without a rope part (a GLM-5 Next's DSA layers are NoPE). Three pages for five
    rows, so a resume often finds no room while a mamba slot is free."""
    return mla_ssm.replace(name="dsa-ssm-ps64", architecture="glm5-next", attention="dsa", page_size=64,
                           index_head_dim=128, qk_rope_head_dim=0, full_tokens=192, max_context=192)


def _mode_configs(base: list[ModelConfig]) -> list[ModelConfig]:
    """Hybrid models in SGLang's mamba extra-buffer mode with the overlap schedule: each request
    holds a ping-pong pair of track slots beside its state slot (three slots a request)."""
    hybrid = next(c for c in base if c.name == "hybrid-linear")
    return [hybrid.replace(name="hybrid-extra-buffer", mamba_track_slots=2, mamba_slots=10),
            # MTP with three drafts a step: each verify fills draft steps 0..3 of the request's scratch row
            hybrid.replace(name="hybrid-spec", spec_draft_tokens=4)]


def _spec_long(spec: ModelConfig) -> ModelConfig:
    """A speculative hybrid with a context shorter than its pool (32 tokens against 48), so requests (prompts of up to
    40 tokens) run up to the context boundary, where a server's per-round KV reserve for the drafts meets the end of
    the request row: five tokens verified a round (a tree of four drafts on the scheduler path)."""
    return spec.replace(name="hybrid-spec-long", spec_draft_tokens=5, max_context=32)


def _memory_configs(base: list[ModelConfig]) -> list[ModelConfig]:
    """Servers sized by their memory, as most are launched (no --max-total-tokens, --max-mamba-cache-size or
    --swa-full-tokens-ratio): SGLang's configurator splits 8 KiB between the full-attention and window pools at its
    default ratio (on 0.5.23: 49 and 39 tokens), and between the KV and the mamba state (72 tokens and 7 state slots,
    which cap the running requests at 2: three slots a request). Their sizes above are the caps of the server they
    were copied from, unused."""
    named = {c.name: c for c in base}
    return [named["swa"].replace(name="swa-mem", free_memory_kib=8),
            named["hybrid-linear"].replace(name="hybrid-linear-mem", free_memory_kib=8)]


def _paged(config: ModelConfig, page_size: int, kv_dtype: str) -> ModelConfig:
    return config.replace(
        # The full pool keeps its size in tokens (so fewer, larger pages fill up as fast); the
        # SWA side doubles, since whole pages of it stay held at both ends of the window.
        name=f"{config.name}-ps{page_size}", page_size=page_size, kv_dtype=kv_dtype,
        full_tokens=config.full_tokens, swa_tokens=config.swa_tokens * 2,
        # The window stays as it is: with pages of 4 and a window of 6, resumes land on a frontier
        # that lags by a page often, which is where the SWA reload bugs show.
        sliding_window=config.sliding_window,
    )


def _all_configs() -> dict[str, ModelConfig]:
    out = {}
    paged_dtypes = {"dense": "fp8_e4m3", "swa": "bfloat16", "hybrid-linear": "float32",
                    "swa-ssm": "float16", "mla": "bfloat16", "dsa": "bfloat16", "fp8-scaled": "fp8_e4m3",
                    "hybrid-extra-buffer": "float32", "hybrid-spec": "bfloat16",
                    "dense-cpu-fp8": "fp8_e4m3", "mla-fp4": "bfloat16",
                    "minimax-sparse": "fp8_e4m3", "minimax-sparse-konly": "bfloat16", "mla-ssm": "bfloat16",
                    "dense-fp4": "bfloat16"}
    for base in _base_configs() + _storage_configs() + _hybrid_storage_configs() + _mode_configs(_base_configs()):
        out[base.name] = base
        paged = _paged(base, 4, paged_dtypes[base.name])
        out[paged.name] = paged
    out["dsa-ps64"] = _dsa_ps64(out["dsa"])
    out["dsa-ssm-ps64"] = _dsa_ssm_ps64(out["mla-ssm"])
    out["swa-only"] = _swa_only()
    out["hybrid-spec-long"] = _spec_long(out["hybrid-spec"])
    out.update((c.name, c) for c in _memory_configs(_base_configs()))
    return out


def _swa_only() -> ModelConfig:
    """Every layer sliding-window (SGLang's all-SWA path: PureSWATokenToKVPoolAllocator and PureSWARadixCache): the
    token slots are the window's own, freed as the window slides, at page size 1 only. The window lets a request
    outgrow the pool, so its row (the context) is what ends it."""
    return ModelConfig(name="swa-only", architecture="gpt-oss", full_layers=0, swa_layers=2, sliding_window=6,
                       full_tokens=0, swa_tokens=40, request_rows=5, max_context=64, kv_dtype="bfloat16")


def _dsa_ps64(dsa: ModelConfig) -> ModelConfig:
    """DSA in the shape SGLang's indexer takes (0.5.23 asserts 64-token pages and 128-value index keys),
    so ``--family sglang`` builds its DSATokenToKVPool. Four pages for five rows: a fifth request waits.
    The context is the pool, as in every named config (a request's row never runs out before the pool)."""
    return dsa.replace(name="dsa-ps64", page_size=64, index_head_dim=128, full_tokens=256, max_context=256)


CONFIGS: dict[str, ModelConfig] = _all_configs()


def get_config(name: str) -> ModelConfig:
    """The built-in config of that name, or a ConfigError that lists the names there are."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ConfigError(
            f"unknown config {name!r}; choose one of: {', '.join(CONFIGS)}"
        ) from None
