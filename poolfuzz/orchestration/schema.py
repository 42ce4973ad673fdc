"""The shape of a well-formed artifact: each operation's argument types and every field's type.

An artifact is untrusted input: a file from CI, a bug report or another machine. Everything in it
is checked here, before any pool is built, so a malformed file is a usage error (exit 2) and never
a "reproduction" (exit 1) or a traceback. Only plain JSON values pass: ``bool`` is not an int, a
float is not an int, and every string that names something is one of a fixed set.
"""

from __future__ import annotations

from dataclasses import dataclass

# Larger than any pool poolfuzz builds, and small enough that no argument asks torch for an
# allocation that would take the machine down before the engine says "no room".
INT_LIMIT = 2**31
NODES = ("prefill", "decode")
BACKUP_MODES = ("cpu_tensor", "host_pool")


@dataclass(frozen=True)
class Arg:
    """One operation argument: an int at least ``minimum``, a non-empty list of them, a node name, or a flag
    (``optional``: recorded only where it is set, as ``decode_speculative``'s ``tree``)."""

    kind: str  # "int" | "ints" | "node" | "bool"
    minimum: int = 1
    optional: bool = False

    def problem(self, value) -> str | None:
        """Why ``value`` does not fit, or None."""
        if self.kind == "node":
            return None if isinstance(value, str) and value in NODES else f"must be one of {', '.join(NODES)}"
        if self.kind == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind == "ints":
            if not isinstance(value, list) or not value:
                return "must be a non-empty list of request ids"
            bad = next((v for v in value if not _int_in(v, self.minimum)), None)
            return None if bad is None else f"holds {bad!r}, not an int from {self.minimum} to {INT_LIMIT - 1}"
        return None if _int_in(value, self.minimum) else f"must be an int from {self.minimum} to {INT_LIMIT - 1}"


RID = Arg("int", 1)
# Engine operation -> its arguments. tests/cover/test_untrusted_artifacts.py checks this against
# the Engine's signatures, so a new operation cannot be replayed unchecked.
OPERATION_ARGS: dict[str, dict[str, Arg]] = {
    "admit": {"prompt_len": Arg("int", 1)},
    "prefill": {"rid": RID, "chunk": Arg("int", 1)},
    "decode": {"rids": Arg("ints", 1)},
    "decode_speculative": {"rid": RID, "draft": Arg("int", 1), "accepted": Arg("int", 0),
                           "tree": Arg("bool", optional=True)},
    "evict_swa": {},
    "retract": {"rid": RID},
    "resume": {"node": Arg("node")},
    "abort": {"rid": RID},
    "finish": {"rid": RID},
    "transfer": {"rid": RID},
    "fork": {"src_rid": RID, "extra": Arg("int", 1)},
    "next_turn": {"src_rid": RID, "extra": Arg("int", 1)},
    "flush": {"node": Arg("node")},
}

_STR, _INT, _BOOL = (str,), (int,), (bool,)
# Artifact field -> accepted JSON types (None allowed where listed). Required fields are checked
# by artifacts.load before these.
FIELD_TYPES: dict[str, tuple] = {
    "config": _STR, "device": _STR, "backup_mode": _STR, "failure": _STR, "error_type": _STR,
    "family": _STR, "status": _STR, "created": _STR, "hypothesis_version": _STR, "torch_version": _STR,
    "poolfuzz_version": _STR, "in_teardown": _BOOL, "seed": (int, type(None)), "examples": (int, type(None)),
    "seconds": (int, float, type(None)), "hypothesis_program": (str, type(None)),
    "reproduce_blob": (str, type(None)), "database": (str, type(None)), "database_key": (str, type(None)),
    "faults": (list,), "divergence": (dict,), "program": (list,), "engine_options": (dict, type(None)),
    "signature": (str, type(None)), "shrink_examples": (int, type(None)),
    "model_config": (dict, type(None)), "hypothesis_steps": (int, type(None)), "pools": (dict, type(None)),
}
DIVERGENCE_TYPES: dict[str, tuple] = {
    "kind": _STR, "step": _INT, "op": _STR, "node": _STR, "rid": (int, type(None)),
    "component": (str, type(None)), "layer": (int, type(None)), "position": (int, type(None)),
    "slot_before": (int, type(None)), "slot_after": (int, type(None)), "expected": (str, type(None)),
    "found": (str, type(None)), "detail": _STR, "check": _STR, "action": _STR, "space": (str, type(None)),
}


def _int_in(value, minimum: int) -> bool:
    return type(value) is int and minimum <= value < INT_LIMIT


def _fits(value, types: tuple) -> bool:
    if isinstance(value, bool) and bool not in types:  # True is an int to Python, not to an artifact
        return False
    return isinstance(value, types)


def _names(types: tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def field_problem(raw: dict) -> str | None:
    """The first top-level field of ``raw`` with the wrong type, as a phrase; None if all fit."""
    for key, types in FIELD_TYPES.items():
        if key in raw and not _fits(raw[key], types):
            return f"field {key!r} must be {_names(types)}, got {type(raw[key]).__name__}"
    return None


def step_problem(i: int, raw: dict) -> str | None:
    """Why step ``i`` (1-based) of a program does not fit its operation's schema; None if it does."""
    op, args = raw.get("op"), raw.get("args", {})
    schema = OPERATION_ARGS.get(op)
    if schema is None:
        return f"step {i} names operation {op!r}, which replay does not know"
    if not isinstance(args, dict):
        return f"step {i} ({op}): 'args' must be an object"
    required = {name for name, arg in schema.items() if not arg.optional}
    if not required <= set(args) <= set(schema):
        return f"step {i} ({op}): arguments {sorted(args)} must be {sorted(required)}, optionally with " \
               f"{sorted(set(schema) - required)}"
    for name, arg in schema.items():
        if name not in args:
            continue
        why = arg.problem(args[name])
        if why is not None:
            return f"step {i} ({op}): argument {name}={args[name]!r} {why}"
    if "outcome" in raw and not isinstance(raw["outcome"], str):
        return f"step {i} ({op}): 'outcome' must be a string"
    return None


def divergence_problem(divergence: dict) -> str | None:
    for key, types in DIVERGENCE_TYPES.items():
        if key in divergence and not _fits(divergence[key], types):
            return f"divergence field {key!r} must be {_names(types)}, got {type(divergence[key]).__name__}"
    return None


def pools_problem(pools: dict | None) -> str | None:
    """Why an artifact's ``pools`` (who built the pools its failure ran on) is not {built_by, detail}; None if it is."""
    from poolfuzz.pools.capabilities import POOLS_BUILDERS

    if pools is None:
        return None
    if set(pools) != {"built_by", "detail"} or not isinstance(pools["detail"], str):
        return "field 'pools' must be an object of 'built_by' and a string 'detail'"
    if pools["built_by"] not in POOLS_BUILDERS:
        return f"field 'pools': built_by {pools['built_by']!r} is not one of {', '.join(POOLS_BUILDERS)}"
    return None


def option_problem(options: dict, defaults: dict) -> str | None:
    """Each engine option must have the type of its default (an int option is not a bool)."""
    for key, value in options.items():
        want = type(defaults[key]) if key in defaults else None
        if want in (tuple, list):  # a list of check names (waive) or of failure signatures (known)
            from poolfuzz.harness.failures import WAIVABLE
            from poolfuzz.harness.failures import SIGNATURE

            fits = (lambda v: v in WAIVABLE) if key == "waive" else (lambda v: bool(SIGNATURE.match(v)))
            if not isinstance(value, list) or not all(isinstance(v, str) and fits(v) for v in value):
                return f"engine option {key!r} must be a list of {'waivable check names' if key == 'waive' else 'failure signatures'}, got {value!r:.60}"
            continue
        if want is not None and type(value) is not want:
            return f"engine option {key!r} must be {want.__name__}, got {type(value).__name__}"
        if want is int and not 1 <= value < INT_LIMIT:
            return f"engine option {key!r} must be an int from 1 to {INT_LIMIT - 1}, got {value}"
    return None
