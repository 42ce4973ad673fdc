"""A config as plain fields and as TOML: what an artifact records and what a user keeps in a file.

Both directions treat the text as untrusted input: every field is checked for its exact type
(``bool`` is not an int, a float is not an int) before ``ModelConfig`` validates the values, so a
bad file or artifact is one ConfigError naming the field and the fix, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import ConfigError

# Larger than any pool the harness builds; keeps a hostile file from asking torch for terabytes.
SIZE_LIMIT = 1 << 24
_TUPLE_FIELDS = ("conv_shapes", "temporal_shape")


def config_fields(config: ModelConfig) -> dict:
    """Every field of ``config`` as plain JSON values (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _field_types() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(ModelConfig)}


def config_from_fields(raw, where: str) -> ModelConfig:
    """A ModelConfig from plain values (an artifact's ``model_config``, a TOML table); ConfigError
    naming ``where`` and the field on any problem. Missing fields take their defaults."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a config must be a table of fields, got {type(raw).__name__}")
    known = _field_types()
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown config field {unknown[0]!r} (known: {', '.join(known)})")
    for required in ("name", "architecture"):
        if required not in raw:
            raise ConfigError(f"{where}: the config lacks the field {required!r}")
    values = {}
    for key, value in raw.items():
        if key in _TUPLE_FIELDS:
            values[key] = _shape(key, value, where)
            continue
        want = str if known[key] in ("str", str) else int
        if type(value) is not want:
            raise ConfigError(f"{where}: config field {key!r} must be {'a string' if want is str else 'an integer'}, "
                              f"got {value!r}")
        if want is int and not -SIZE_LIMIT <= value <= SIZE_LIMIT:
            raise ConfigError(f"{where}: config field {key!r}={value} is out of range (at most {SIZE_LIMIT})")
        if want is str and (len(value) > 200 or not value.isprintable()):
            raise ConfigError(f"{where}: config field {key!r} must be a short printable string")
        values[key] = value
    try:
        config = ModelConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if config.max_context < config.full_tokens:  # the engine lets one request grow to the whole pool
        raise ConfigError(f"{where}: max_context ({config.max_context}) must be at least full_tokens "
                          f"({config.full_tokens}): a request may grow to hold the whole pool")
    return config


def _shape(key: str, value, where: str):
    def dims(v) -> tuple[int, ...]:
        if not isinstance(v, list) or not v or not all(type(d) is int and 1 <= d <= 4096 for d in v):
            raise ConfigError(f"{where}: config field {key!r} must hold lists of integers from 1 to 4096, got {v!r}")
        return tuple(v)

    if key == "temporal_shape":
        if value == [0, 0, 0]:  # no temporal state (short convolutions in the attention layers)
            return (0, 0, 0)
        shape = dims(value)
        if len(shape) != 3:
            raise ConfigError(f"{where}: temporal_shape must be [heads, head_dim, state_size] (or [0, 0, 0] for none), "
                              f"got {value!r}")
        return shape
    if not isinstance(value, list) or not value or len(value) > 8:
        raise ConfigError(f"{where}: conv_shapes must be a list of 1 to 8 shapes, got {value!r}")
    return tuple(dims(v) for v in value)


def to_toml(config: ModelConfig) -> str:
    """``config`` as a TOML ``[[config]]`` table, every field written out, ready to edit."""
    lines = ["# A poolfuzz model config: edit it, then `poolfuzz run --config-file FILE.toml`.",
             "# layer_pattern: one letter per layer, F full, S sliding window, M mamba; \"\" = F..S..M..",
             "# recurrent_layers: \"own\" (the M layers) or \"attention\" (state beside the KV of every attention "
             "layer, as Inkling's short convolutions; temporal_shape [0, 0, 0]: none)",
             "[[config]]"]
    for key, value in config_fields(config).items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def load_config_file(path: str) -> list[ModelConfig]:
    """The configs a TOML file names (one ``[[config]]`` table each); ConfigError with the fix."""
    import tomllib

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config-file {path!r} does not exist; write one with "
                          "`poolfuzz configs --show NAME > FILE.toml`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --config-file {path!r} ({exc}); check the path and permissions") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config-file {path!r} is not valid TOML ({exc}); fix the line it names") from None
    tables = data.get("config")
    if set(data) - {"config"} or not isinstance(tables, list) or not tables:
        raise ConfigError(f"--config-file {path!r} must hold one or more [[config]] tables and nothing else; "
                          "see `poolfuzz configs --show dense`")
    configs = [config_from_fields(t, f"--config-file {path!r}, config {i}") for i, t in enumerate(tables, 1)]
    names = [c.name for c in configs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"--config-file {path!r} names config {dup!r} twice; give each config its own name")
    return configs
