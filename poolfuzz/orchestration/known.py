"""Known bugs for ``poolfuzz run --known``: signatures from artifacts, folders of them, or a text file.

A failure whose signature is known is counted and passed over, never reported or shrunk, so a
release with one unfixed bug is still fuzzed everywhere else. Files are untrusted input: an
artifact is read as data (``artifacts.load``), a text file as one signature per line, optionally
after the config it is known on (``swa-only ReferenceMismatch:free-count:swa``): a bug judged on one
config stays a finding on every other; and optionally before that after the ``--family`` it is known through
(``sglang:hicache hybrid-linear StateLost:contents:mamba@teardown``): a bug of one engine path stays a finding on
every other path over the same config.
"""

from __future__ import annotations

import json
from pathlib import Path

from poolfuzz.errors import UsageError
from poolfuzz.harness.failures import SIGNATURE


def load_known(path: str) -> tuple[str, ...]:
    """The signatures ``path`` names: an artifact, a directory of artifacts, or a text file of
    signatures (one a line, ``#`` starts a comment). Any problem is a UsageError naming the file."""
    where = Path(path)
    if where.is_dir():
        files = sorted(where.glob("*.json"))
        if not files:
            raise UsageError(f"--known {path!r}: the directory holds no .json artifact; pass poolfuzz run's --out "
                             "directory, one artifact, or a text file of signatures")
        return tuple(dict.fromkeys(_from_artifact(f) for f in files))
    if not where.is_file():
        raise UsageError(f"--known {path!r} does not exist; pass an artifact, a directory of artifacts or a "
                         "text file of signatures")
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--known {path!r}: cannot read it ({exc})") from None
    if where.suffix == ".json" or text.lstrip().startswith("{"):
        return (_from_artifact(where),)
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) > 3 or not SIGNATURE.match(fields[-1]):
            raise UsageError(f"--known {path}: line {number} is not a failure signature ({line[:60]!r}); "
                             "signatures read like StateLost:contents:mamba@resume, optionally after a config "
                             "name (swa-only StateLost:contents:swa@resume), and that after a family name "
                             "(sglang:hicache hybrid-linear StateLost:contents:mamba@teardown)")
        out.append(" ".join(fields))
    return tuple(dict.fromkeys(out))


def known_on(known: tuple[str, ...], config: str, family: str | None = None) -> tuple[str, ...]:
    """The signatures known on ``config`` through ``family`` (its ``--family`` name as given, ``builtin`` for the
    built-in one; None matches no family-qualified entry): every unqualified one, those given for that config, and
    those given for that family and config."""
    out = []
    for entry in known:
        *where, signature = entry.split(" ")
        if where in ([], [config], [family, config]):
            out.append(signature)
    return tuple(dict.fromkeys(out))


def _from_artifact(path: Path) -> str:
    from poolfuzz.orchestration import artifacts

    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass  # artifacts.load says what is wrong, as for replay
    art = artifacts.load(path)
    return art.signature
