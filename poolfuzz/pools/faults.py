"""Catalogue of switchable faults, each a small override that reproduces a bug SGLang shipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.protocol import ServingProtocol


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One historical bug class, switched on by id through ``build_family(..., faults=[id])``."""

    id: str
    description: str
    upstream: str  # the SGLang PR or commit it mirrors
    applies_to: Callable[[ModelConfig], bool]
    overrides: dict  # Blueprint field -> replacement

    def __repr__(self) -> str:
        return f"Fault({self.id})"


# --- #35957 ----------------------------------------------------------------------------------
class CallerSkipsMambaBackup(ServingProtocol):
    """Pre-#35957 ``offload_kv_cache``: trusts the KV pool with ``mamba_indices``. SWAKVPool
    accepts and ignores them, so nobody backs the recurrent state up."""

    def mamba_pool_needing_backup(self, req, family):
        return None


def _swa_and_mamba(c: ModelConfig) -> bool:
    return c.has_swa and c.has_mamba


FAULTS: dict[str, Fault] = {
    f.id: f
    for f in [
        Fault(
            id="swa-ignores-mamba-backup",
            description="SWA pool ignores mamba_indices and the caller does not back the recurrent state up",
            upstream="sglang#35957",
            applies_to=_swa_and_mamba,
            overrides={"protocol": CallerSkipsMambaBackup},
        ),
    ]
}


def get_fault(fault_id: str) -> Fault:
    try:
        return FAULTS[fault_id]
    except KeyError:
        raise ConfigError(f"unknown fault {fault_id!r}; known faults: {', '.join(FAULTS)}") from None


def blueprint_with(fault_ids: Iterable[str], config: ModelConfig):
    """The default blueprint with each named fault's overrides applied; validates the ids."""
    from poolfuzz.pools.family import Blueprint, replace_blueprint

    bp = Blueprint()
    seen: dict[str, str] = {}
    for fid in fault_ids:
        fault = get_fault(fid)
        if not fault.applies_to(config):
            raise ConfigError(f"fault {fid!r} does not apply to config {config.name!r}; "
                              f"configs it applies to: {', '.join(applicable_configs(fid))}")
        for role in fault.overrides:
            if role in seen:
                raise ConfigError(f"faults {seen[role]!r} and {fid!r} both replace the {role}; "
                                  "switch them on one at a time")
            seen[role] = fid
        bp = replace_blueprint(bp, **fault.overrides)
    return bp


def applicable_configs(fault_id: str) -> list[str]:
    from poolfuzz.pools.config import CONFIGS

    fault = get_fault(fault_id)
    return [name for name, c in CONFIGS.items() if fault.applies_to(c)]
