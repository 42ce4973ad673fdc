"""The classes a family is built from; a catalogue fault replaces one of them (or composes with another)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from poolfuzz.pools.allocator import TokenAllocator
from poolfuzz.pools.attention_kinds import kind_of
from poolfuzz.pools.config import ModelConfig, uses_ssm_state
from poolfuzz.pools.host import HostKVPool
from poolfuzz.pools.kv import HybridLinearKVPool, MHATokenToKVPool, SWAKVPool
from poolfuzz.pools.latent import DSATokenToKVPool, MLATokenToKVPool
from poolfuzz.pools.latent_fp4 import MLATokenToKVPoolFP4
from poolfuzz.pools.mha_fp4 import MHATokenToKVPoolFP4
from poolfuzz.pools.minimax_sparse import MiniMaxSparseKVPool
from poolfuzz.pools.quantised import MHATokenToKVPoolQuantised
from poolfuzz.pools.scaled import MHATokenToKVPoolScaled
from poolfuzz.pools.mamba import MambaPool, MambaSlotAllocator
from poolfuzz.pools.prefix_tree import MambaPrefixTree
from poolfuzz.pools.protocol import ServingProtocol
from poolfuzz.pools.pure_swa import PureSWAKVPool, PureSWATokenAllocator
from poolfuzz.pools.req_to_token import HybridReqToTokenPool, ReqToTokenPool
from poolfuzz.pools.speculative import SpeculativeScratch
from poolfuzz.pools.swa_allocator import SWATokenAllocator
from poolfuzz.pools.transfer import PDTransfer


@dataclass(frozen=True, kw_only=True)
class Blueprint:
    """The classes (and the SSM predicate) a family is built from. A fault replaces one of them."""

    mha_kv_pool: type = MHATokenToKVPool
    scaled_kv_pool: type = MHATokenToKVPoolScaled
    quant_kv_pool: type = MHATokenToKVPoolQuantised  # built with a KV quant method (config.kv_quant)
    mla_kv_pool: type = MLATokenToKVPool
    mla_fp4_kv_pool: type = MLATokenToKVPoolFP4  # MLA with kv_quant fp4_mx_block16
    mha_fp4_kv_pool: type = MHATokenToKVPoolFP4  # MHA with kv_quant fp4_mx_block16
    dsa_kv_pool: type = DSATokenToKVPool
    msa_kv_pool: type = MiniMaxSparseKVPool  # MiniMax sparse attention (attention "msa")
    swa_kv_pool: type = SWAKVPool
    hybrid_kv_pool: type = HybridLinearKVPool
    mamba_pool: type = MambaPool
    req_pool: type = ReqToTokenPool
    hybrid_req_pool: type = HybridReqToTokenPool
    token_allocator: type = TokenAllocator
    swa_allocator: type = SWATokenAllocator
    pure_swa_kv_pool: type = PureSWAKVPool  # an all-SWA model's (no full attention)
    pure_swa_allocator: type = PureSWATokenAllocator
    host_pool: type = HostKVPool
    protocol: type = ServingProtocol
    transfer: type = PDTransfer
    mamba_allocator: type = MambaSlotAllocator
    spec_scratch: type = SpeculativeScratch  # speculative decoding's intermediate state caches
    prefix_tree: type = MambaPrefixTree  # the checkpoints of the prefix cache (recurrent-state models)
    ssm_predicate: Callable[[ModelConfig], bool] = uses_ssm_state
    backup_resolver: Callable[..., str] = None  # None: resolve_backup_mode

    def kv_pool_class(self, config: ModelConfig) -> type:
        """The KV pool class a config is built with: SWA, hybrid-linear (mamba), else its attention kind's pool
        (``attention_kinds.KINDS``: MLA, DSA, MiniMax sparse, or the per-token MHA pool)."""
        if config.has_swa:
            return self.swa_kv_pool if config.has_full else self.pure_swa_kv_pool
        if config.has_mamba:
            return self.hybrid_kv_pool
        return self.full_attention_pool(config)

    def full_attention_pool(self, config: ModelConfig) -> type:
        """The pool of a model whose full attention is the config's only KV: its attention kind's."""
        pools = kind_of(config).pools
        return self.token_kv_pool(config) if pools is None else getattr(self, pools[config.kv_quant])

    def token_kv_pool(self, config: ModelConfig) -> type:
        """The per-token MHA pool (also the sub-pool of SWA and hybrid-linear pools)."""
        if config.kv_quant == "fp4_mx_block16":
            return self.mha_fp4_kv_pool
        if config.kv_quant:
            return self.quant_kv_pool
        return self.scaled_kv_pool if config.kv_scale_block else self.mha_kv_pool

    def hybrid_full_pool(self, config: ModelConfig) -> type:
        """The full-attention sub-pool of a hybrid-linear pool: the attention kind's pool for it (MLA latent rows
        for Kimi-Linear, SGLang's ``HybridLinearKVPool(use_mla=True)``; DSA, ``use_dsa``), else the per-token MHA
        pool."""
        field = kind_of(config).beside_recurrent
        return self.token_kv_pool(config) if field is None else getattr(self, field)
