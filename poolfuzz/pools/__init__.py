"""Real memory pools with SGLang's semantics, their reference models, and the family builder.

This layer imports nothing from ``poolfuzz.harness`` or ``poolfuzz.strategies`` and touches no
CUDA API at import time.
"""

from poolfuzz.pools.config import CONFIGS, ModelConfig, get_config, uses_ssm_state
from poolfuzz.pools.errors import (
    ConfigError,
    DoubleAlloc,
    DoubleFree,
    InvalidSlot,
    MisalignedAlloc,
    PoolError,
    PoolExhausted,
    UnsupportedBackup,
)
from poolfuzz.pools.family import PoolFamily, build_family

__all__ = [
    "CONFIGS",
    "ConfigError",
    "DoubleAlloc",
    "DoubleFree",
    "InvalidSlot",
    "MisalignedAlloc",
    "ModelConfig",
    "PoolError",
    "PoolExhausted",
    "PoolFamily",
    "UnsupportedBackup",
    "build_family",
    "get_config",
    "uses_ssm_state",
]
