"""Failure artifacts: one JSON file per failure, written atomically, with a schema version.

An artifact holds everything needed to replay a failure without Hypothesis: the config, device,
faults and backup mode, the engine-level program (``program``: steps with their arguments),
the structured divergence, and for reference Hypothesis's printed program and reproduce blob.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from poolfuzz.errors import UsageError
from poolfuzz.harness.program import check_steps, step_to_json
from poolfuzz.harness.records import StepRecord
from poolfuzz.orchestration import schema
from poolfuzz.orchestration.stopping import stop_signals_deferred

SCHEMA = "poolfuzz-failure"
VERSION = 1
DEFAULT_OUT = "poolfuzz-failures"
STATUSES = ("shrunk", "shrinking", "interrupted", "shrink-limit")


class ArtifactError(UsageError):
    """A file that is not a readable artifact of this schema: one line, exit 2."""


@dataclass(kw_only=True)
class Artifact:
    config: str
    device: str
    faults: list[str]
    backup_mode: str
    seed: int | None
    failure: str  # the one-line report
    error_type: str  # StateLost, InvariantViolation, ReferenceMismatch, or a crash's exception class
    divergence: dict
    program: list[StepRecord]
    family: str = "builtin"  # the pool family (--family): builtin, a plug-in name or module:factory
    # Every field of the config when it is not the built-in of that name (drawn, or from a
    # --config-file): replay and emit-test rebuild it from here, with no file. None: by name.
    model_config: dict | None = None
    status: str = "shrunk"  # shrunk | shrinking (best so far, still going) | interrupted | shrink-limit
    in_teardown: bool = False  # the failure came from the final sweep / drain, after the program
    engine_options: dict = field(default_factory=dict)
    hypothesis_program: str | None = None
    reproduce_blob: str | None = None
    database: str | None = None
    database_key: str | None = None
    examples: int | None = None  # examples the run took to first see this failure (cost to find)
    seconds: float | None = None  # seconds the run took to first see it
    signature: str | None = None  # failures.signature_from: names the bug, not the example
    shrink_examples: int | None = None  # examples Hypothesis ran shrinking it
    # Steps of Hypothesis's shrink, when poolfuzz then deleted more (harness.minimise); None: it could not.
    hypothesis_steps: int | None = None
    # Who built the pools the failure ran on ({"built_by": poolfuzz | engine | adapter, "detail": how}); None where the
    # family does not say, or the file was written before artifacts recorded it.
    pools: dict | None = None
    created: str = ""
    hypothesis_version: str = ""
    torch_version: str = ""
    poolfuzz_version: str = ""
    version: int = VERSION
    schema: str = SCHEMA
    # The family the file names where its program now runs on another (see load_checked); never written.
    renamed_from: str = ""

    def to_json(self) -> dict:
        out = asdict(self)
        del out["renamed_from"]
        out["program"] = [step_to_json(s) for s in self.program]
        # the identifying fields first, for a reader of the raw file
        head = ("schema", "version", "status", "signature", "config", "model_config", "family", "device", "faults",
                "backup_mode", "seed", "failure",
                "error_type", "divergence", "in_teardown", "program")
        return {k: out[k] for k in head} | {k: v for k, v in out.items() if k not in head}


def stamp(**fields) -> Artifact:
    """An artifact with the versions of this environment and the current time filled in."""
    import hypothesis
    import torch

    from poolfuzz import __version__ as _pv

    return Artifact(created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    hypothesis_version=hypothesis.__version__, torch_version=torch.__version__,
                    poolfuzz_version=_pv, **fields)


def pools_record(origin) -> dict | None:
    """What an artifact records of who built the pools a failure ran on (a ``PoolsOrigin``, or None)."""
    return None if origin is None else origin.to_json()


def artifact_name(config: str, faults, when: _dt.datetime | None = None, tag: str = "") -> str:
    when = when or _dt.datetime.now()
    parts = [config] + list(faults)
    base = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(parts))
    return f"{base}-{when:%Y%m%d-%H%M%S}{'-' + tag if tag else ''}.json"


def dumps(artifact: Artifact) -> str:
    """Indented JSON with one step of the program per line."""
    data = artifact.to_json()
    steps = data["program"]
    text = json.dumps(data | {"program": "@PROGRAM@"}, indent=2)
    lines = ",\n".join("    " + json.dumps(s) for s in steps)
    return text.replace('"@PROGRAM@"', "[\n" + lines + "\n  ]" if steps else "[]") + "\n"


def write_atomic(path: str | os.PathLike, artifact: Artifact) -> Path:
    """Write the artifact so a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, dumps(artifact))
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, then rename over ``path``."""
    with stop_signals_deferred():  # a Ctrl-C or SIGTERM lands after the rename, never between temp and rename
        tmp = _temp_copy(path.parent, path.name, text)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise


def write_new_atomic(folder: str | os.PathLike, name_for, artifact: Artifact) -> Path:
    """Write the artifact under ``folder / name_for(k)`` for the first k = 1, 2, ... whose name is
    free, and return that path. Choosing the name and creating the file are one atomic step (a hard
    link of the finished temp file, which fails if the name exists): two runs with one --out in the
    same second never share a file, and no reader ever sees an empty or partial artifact."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = dumps(artifact)
    with stop_signals_deferred():  # as in write_text_atomic: no stop signal between temp file and link
        tmp = _temp_copy(folder, name_for(1), text)
        try:
            return _link_under_free_name(tmp, folder, name_for)
        finally:
            _unlink(tmp)


def _link_under_free_name(tmp: str, folder: Path, name_for) -> Path:
    k = 1
    while True:
        path = folder / name_for(k)
        try:
            os.link(tmp, path)
            return path
        except FileExistsError:
            k += 1
        except OSError:  # a filesystem without hard links: reserve the name, then rename over it
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            except FileExistsError:
                k += 1
                continue
            os.replace(tmp, path)
            return path


STALE_TEMP_SECONDS = 600.0  # a write takes milliseconds: a temp file this old was left by a killed process


def sweep_stale_temps(folder: str | os.PathLike) -> list[str]:
    """Remove the hidden temp files a killed run left in ``folder`` (SIGKILL mid-write: nothing can
    clean up then); the names removed. Only this module's own names (``.<name>.<random>.tmp``) and only
    old ones: a run sharing the folder may be writing one right now."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    now = time.time()
    gone = []
    for entry in folder.iterdir():
        name = entry.name
        if not (name.startswith(".") and name.endswith(".tmp")) or not entry.is_file():
            continue
        try:
            if now - entry.stat().st_mtime < STALE_TEMP_SECONDS:
                continue
            entry.unlink()
            gone.append(name)
        except OSError:  # another run swept it first, or it is not ours to remove
            continue
    return gone


def _temp_copy(folder: Path, name: str, text: str) -> str:
    """``text`` in a fsynced temp file in ``folder``, with the mode any tool would give it (0o666
    less the umask: mkstemp's 0600 would hide artifacts and emitted tests from a team)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it; set it straight back
    os.umask(mask)
    return mask


_REQUIRED = {"config": str, "device": str, "faults": list, "backup_mode": str, "failure": str,
             "divergence": dict, "program": list}


def load(path: str | os.PathLike) -> Artifact:
    """Read and validate an artifact; any problem is an ArtifactError naming it and the fix."""
    name = str(path)
    rerecord = "re-record it with poolfuzz run (or take the copy CI uploaded)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"artifact {name} does not exist; pass the path of a .json file that "
                            f"poolfuzz run wrote (by default under ./{DEFAULT_OUT}/)") from None
    except IsADirectoryError:
        raise ArtifactError(f"{name} is a directory; pass one .json artifact from it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read artifact {name} ({exc}); check the path and permissions") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        body = text.rstrip()
        cut = exc.pos >= len(body) - 1 or exc.msg.startswith("Unterminated") or (
            body.startswith("{") and not body.endswith("}"))
        raise ArtifactError(f"artifact {name} is {'truncated' if cut else 'malformed'} JSON ({exc.msg}: line "
                            f"{exc.lineno}, column {exc.colno}); {rerecord}") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise ArtifactError(f"{name} is not a poolfuzz failure artifact (no \"schema\": \"{SCHEMA}\"); "
                            f"pass a file that poolfuzz run wrote under ./{DEFAULT_OUT}/")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"artifact {name} has no valid schema version ({version!r}); {rerecord}")
    if version > VERSION:
        raise ArtifactError(f"artifact {name} uses schema version {version}, newer than this poolfuzz reads "
                            f"(up to {VERSION}); upgrade poolfuzz (pip install -U poolfuzz) to replay it")
    for key, typ in _REQUIRED.items():
        if key not in raw:
            raise ArtifactError(f"artifact {name} lacks the field {key!r}; {rerecord}")
        if not isinstance(raw[key], typ):
            raise ArtifactError(f"artifact {name}: field {key!r} must be {typ.__name__}, "
                                f"got {type(raw[key]).__name__}; {rerecord}")
    if not all(isinstance(f, str) for f in raw["faults"]):
        raise ArtifactError(f"artifact {name}: 'faults' must be a list of fault ids; {rerecord}")
    options = raw.get("engine_options") or {}
    if not isinstance(options, dict):
        raise ArtifactError(f"artifact {name}: 'engine_options' must be an object; {rerecord}")
    problem = schema.field_problem(raw)
    if problem is None and raw["backup_mode"] not in schema.BACKUP_MODES:
        problem = (f"backup_mode {raw['backup_mode']!r} is not a retraction path (known: "
                   f"{', '.join(schema.BACKUP_MODES)})")
    if problem is None:
        problem = schema.divergence_problem(raw["divergence"])
    if problem is None:
        problem = schema.pools_problem(raw.get("pools"))
    if problem is not None:
        raise ArtifactError(f"artifact {name}: {problem}; {rerecord}")
    if _scheduler_program(raw["program"]):  # a family that drives the engine's scheduler (harness/scheduled.py)
        program, problem = _scheduler_steps(raw["program"])
        problem = None if problem is None else f"scheduler {problem}"
    else:
        try:
            program = check_steps(raw["program"])
        except ValueError as exc:
            raise ArtifactError(f"artifact {name}: {exc}; {rerecord}") from None
        # Each argument's type and range too: a step the engine would choke on is a bad file, not a bug found.
        problem = next(filter(None, (schema.step_problem(i, s) for i, s in enumerate(raw["program"], 1))), None)
    if problem is not None:
        raise ArtifactError(f"artifact {name}: program {problem}; {rerecord}")
    known = {f for f in Artifact.__dataclass_fields__}
    fields = {k: v for k, v in raw.items() if k in known and k != "program"}
    fields["engine_options"] = options
    fields.setdefault("seed", None)
    fields.setdefault("error_type", raw["failure"].split(":", 1)[0])
    if not fields.get("signature"):  # recorded before signatures existed: the same string, from the record
        from poolfuzz.harness.failures import signature_from

        fields["signature"] = signature_from(fields["error_type"], raw["divergence"],
                                             in_teardown=bool(raw.get("in_teardown")))
    return Artifact(program=program, **fields)


def _scheduler_program(raw_program) -> bool:
    """Whether a program's steps are scheduler ops (its first step says: a run records one kind)."""
    from poolfuzz.harness.scheduled import PREFIX

    first = raw_program[0] if isinstance(raw_program, list) and raw_program else None
    return isinstance(first, dict) and isinstance(first.get("op"), str) and first["op"].startswith(PREFIX)


def _scheduler_steps(raw_program) -> tuple[list[StepRecord], str | None]:
    from poolfuzz.harness.scheduled import check_program

    if not all(isinstance(s, dict) and isinstance(s.get("args", {}), dict) for s in raw_program):
        return [], "program: every step must be an object with 'op' and 'args'"
    steps = [StepRecord(op=str(s.get("op")), args=dict(s.get("args", {})), outcome=str(s.get("outcome", "")))
             for s in raw_program]
    problem = check_program(steps)
    return steps, None if problem is None else f"program {problem}"


def is_scheduler_program(artifact: Artifact) -> bool:
    """Whether the artifact's program is scheduler ops (``poolfuzz replay`` runs it on the ScheduledMachine)."""
    from poolfuzz.harness.scheduled import OPERATIONS

    return bool(artifact.program) and artifact.program[0].op in OPERATIONS


def resolve(artifact: Artifact, name: str, *, trusted_family: str | None = None):
    """The config and checked faults an artifact names, or an ArtifactError with the fix.

    The artifact's family is resolved only if it is shipped, an installed plug-in, or equal to
    ``trusted_family`` (the ``--family`` the user typed): a file never chooses code to run.
    """
    from poolfuzz.pools.config import CONFIGS
    from poolfuzz.pools.faults import FAULTS

    if artifact.model_config is not None:
        from poolfuzz.pools.config_file import config_from_fields
        from poolfuzz.pools.errors import ConfigError

        try:
            config = config_from_fields(artifact.model_config, f"artifact {name}: model_config")
        except ConfigError as exc:
            raise ArtifactError(f"{exc}; re-record it with poolfuzz run") from None
    elif artifact.config not in CONFIGS:
        raise ArtifactError(f"artifact {name} names config {artifact.config!r}, which this poolfuzz does not "
                            f"have (built-in: {', '.join(CONFIGS)}); replay it with the poolfuzz that recorded "
                            f"it ({artifact.poolfuzz_version or 'unknown version'})")
    unknown = [f for f in artifact.faults if f not in FAULTS]
    if unknown:
        raise ArtifactError(f"artifact {name} switches on fault {unknown[0]!r}, which this poolfuzz's catalogue "
                            f"lacks (known: {', '.join(FAULTS)}); replay it with the poolfuzz that recorded it")
    if not isinstance(artifact.family, str) or not artifact.family:
        raise ArtifactError(f"artifact {name}: 'family' must be a pool family name; re-record it with poolfuzz run")
    if artifact.family != "builtin" or trusted_family not in (None, "builtin"):
        from poolfuzz.orchestration.plugins import resolve_recorded
        from poolfuzz.pools.errors import ConfigError

        try:
            resolve_recorded(artifact.family, trusted=trusted_family)
        except ConfigError as exc:
            raise ArtifactError(f"artifact {name} was {exc}") from None
    if artifact.model_config is None:
        config = CONFIGS[artifact.config]
    for fid in artifact.faults:  # a file that switches a fault on where it cannot apply is bad input
        if not FAULTS[fid].applies_to(config):
            raise ArtifactError(f"artifact {name}: fault {fid!r} does not apply to its config; re-record it "
                                "with poolfuzz run")
    return config, list(artifact.faults)


def load_checked(path, *, trusted_family: str | None = None) -> tuple[Artifact, object, list[str], dict]:
    """An artifact that replays here: (artifact, config, faults, engine options), or ArtifactError
    naming what does not (a bad file, an unknown config, fault, untrusted family or engine option). An engine
    program recorded on a family whose engine-operation path was renamed (``plugins.ENGINE_PROGRAMS_OF``) comes
    back under the new name, with ``renamed_from`` saying which it named."""
    from poolfuzz.orchestration.plugins import ENGINE_PROGRAMS_OF

    art = load(path)
    if art.program and not is_scheduler_program(art) and art.family in ENGINE_PROGRAMS_OF:
        art = replace(art, family=ENGINE_PROGRAMS_OF[art.family], renamed_from=art.family)
    options = engine_options(art, str(path))
    config, faults = resolve(art, str(path), trusted_family=trusted_family)
    return art, config, faults, options


def renamed_note(art: Artifact) -> str:
    """The line that tells a user their artifact runs on a renamed family (empty where it does not)."""
    if not art.renamed_from:
        return ""
    return (f"note: recorded on family {art.renamed_from!r} when it took engine operations; that path is "
            f"{art.family!r} now, and runs there\n")


def family_factory(family: str | None):
    """The factory of a family an artifact names (None for the built-in family)."""
    if not family or family == "builtin":
        return None
    from poolfuzz.orchestration.plugins import resolve_family

    return resolve_family(family).factory


def current_engine_options(options=None) -> dict:
    """The engine options a run used (default: this poolfuzz's machine's), as an artifact records them."""
    from poolfuzz.harness.records import EngineOptions

    out = asdict(options or EngineOptions())
    out["waive"], out["known"] = list(out["waive"]), list(out["known"])
    return out


def engine_options(artifact: Artifact, name: str) -> dict:
    from poolfuzz.harness.records import EngineOptions

    known = EngineOptions.__dataclass_fields__
    bad = [k for k in artifact.engine_options if k not in known]
    if bad:
        raise ArtifactError(f"artifact {name}: unknown engine option {bad[0]!r} (known: {', '.join(known)}); "
                            "replay it with the poolfuzz that recorded it")
    problem = schema.option_problem(artifact.engine_options, current_engine_options())
    if problem is not None:
        raise ArtifactError(f"artifact {name}: {problem}; replay it with the poolfuzz that recorded it")
    options = dict(artifact.engine_options)
    for key in ("waive", "known"):  # JSON has lists; the options are frozen
        if key in options:
            options[key] = tuple(options[key])
    if options:  # every option the recording poolfuzz had is listed; a later one was off then
        for key, then in EngineOptions.RECORDED_BEFORE.items():
            options.setdefault(key, then)
    return options


def recorded_config(config) -> dict | None:
    """What an artifact records of ``config``: None for a built-in (its name says it all), else
    every field, so a drawn or file config replays with no file."""
    from poolfuzz.pools.config import CONFIGS
    from poolfuzz.pools.config_file import config_fields

    if config is None or CONFIGS.get(config.name) == config:
        return None
    return config_fields(config)


def from_program(config, steps, *, faults=(), device="cpu", backup_mode: str | None = None,
                 seed: int | None = None, family: str = "builtin") -> Artifact:
    """Run a hand-written program (steps as dicts or StepRecords) and record how it fails.

    Useful to pin a known failure as an artifact without fuzzing; raises ValueError if the program
    does not fail.
    """
    from poolfuzz.harness.program import new_engine
    from poolfuzz.pools.config import get_config

    records = check_steps([s if isinstance(s, dict) else step_to_json(s) for s in steps])
    model = get_config(config) if isinstance(config, str) else config
    engine = new_engine(config=model, device=device, faults=faults, backup_mode=backup_mode,
                        family_factory=family_factory(family))
    with engine:
        return _record(engine, records, model=model, family=family, faults=faults, seed=seed)


def _record(engine, records, *, model, family, faults, seed) -> Artifact:
    from poolfuzz.harness.failures import divergence_of, message_of
    from poolfuzz.harness.program import replay

    recorded: list[StepRecord] = []
    for ev in replay(engine, records):
        if ev.cannot_run:
            raise ValueError(f"step {ev.index} cannot run: {ev.cannot_run}")
        if ev.step is not None:
            recorded.append(StepRecord(op=ev.step.op, args=ev.step.args, outcome=ev.outcome))
        if ev.failure is not None:
            exc = ev.failure
            return stamp(config=model.name, model_config=recorded_config(model), family=family, device=str(engine.device), faults=list(faults),
                         backup_mode=engine.backup_mode, seed=seed, failure=message_of(exc),
                         error_type=type(exc).__name__, divergence=divergence_of(exc, engine), program=recorded,
                         in_teardown=ev.step is None, engine_options=current_engine_options(),
                         pools=pools_record(engine.pools_origin))
    raise ValueError(f"the program ran clean on {model.name} (faults {list(faults)}): nothing to record")


def slug(text: str) -> str:
    """A lower-case identifier fragment: what a test file or function may be named after."""
    return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9]", "_", str(text))).strip("_").lower() or "x"
