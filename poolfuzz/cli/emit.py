"""``poolfuzz emit-test FILE -o PATH``: turn a failure artifact into a standalone pytest module.

The module builds the family and runs the shrunk program as plain engine calls, each followed by
``engine.check()``, which asserts that every component of every touched request survived. It
fails while the bug is present and passes once it is fixed.
"""

from __future__ import annotations


import os
import sys
from pathlib import Path

from poolfuzz.orchestration.artifacts import slug


def register(sub) -> None:
    p = sub.add_parser("emit-test", help="write a standalone pytest regression test from a failure artifact",
                       description="Write a readable pytest module that replays a failure artifact's program; "
                                   "it fails while the bug is present and passes once it is fixed.")
    p.add_argument("file", metavar="FILE", help="a JSON artifact written by poolfuzz run")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="the test module to write (a .py file)")
    p.set_defaults(handler=main)


def main(args, out=None) -> int:
    from poolfuzz.orchestration import artifacts
    from poolfuzz.errors import UsageError

    out = out or sys.stdout
    art = artifacts.load_checked(args.file)[0]  # what cannot replay here: one line, exit 2, nothing written
    path = Path(args.output)
    if path.is_dir():
        raise UsageError(f"-o {args.output!r} is a directory; name the file, e.g. "
                         f"{path / f'test_regression_{slug(art.config)}.py'}")
    if path.suffix != ".py":
        raise UsageError(f"-o {args.output!r} must name a .py file (pytest collects test_*.py); "
                         f"for example -o test_regression_{slug(art.config)}.py")
    if not path.parent.is_dir():
        raise UsageError(f"-o {args.output!r}: the directory {str(path.parent)!r} does not exist; create it first")
    source = render(art, source_name=os.path.basename(str(args.file)))
    compile(source, str(path), "exec")  # never write a module that does not parse
    artifacts.write_text_atomic(path, source)
    out.write(f"wrote {path}: {len(art.program)} steps on {art.config}"
              + (f" with {', '.join(art.faults)}" if art.faults else "")
              + f"; run it with: python -m pytest {path}\n")
    if not path.name.startswith("test_"):
        out.write(f"note: pytest collects test_*.py files by default; name it test_{path.name} to have it collected\n")
    return 0


def render(art, *, source_name: str = "") -> str:
    """The test module's source."""
    from poolfuzz.orchestration.artifacts import engine_options

    options = engine_options(art, source_name or "artifact")
    kind = (art.divergence or {}).get("kind") or art.error_type
    plugin = art.family != "builtin"
    op = (art.divergence or {}).get("op") or "teardown"
    name = f"test_{slug(art.config)}_{slug(kind)}_at_{slug(op)}"
    failure = art.failure.replace('"""', "'''")
    lines = [
        '"""Regression test from a shrunk poolfuzz failure.',
        "",
        f"Recorded on {art.device} ({art.status}) with poolfuzz {art.poolfuzz_version or '?'}, "
        f"Hypothesis {art.hypothesis_version or '?'}" + (f", from {source_name}" if source_name else "") + ":",
        "",
        *_wrap(failure, "    "),
        "",
        "Each step is one engine operation on a real pool family (a prefill and a decode node) and its",
        "reference model; engine.check() after it compares every component of every request the step",
        "touched, slot by slot, and raises StateLost / InvariantViolation / ReferenceMismatch naming",
        "whose data is where. The test fails while the bug is present and passes once it is fixed.",
        '"""',
        "",
        "import os",
        "",
        "from poolfuzz.harness.engine import Engine, EngineOptions",
        *(["from poolfuzz.orchestration.plugins import resolve_family"] if plugin else []),
        "from poolfuzz.pools.config import get_config",
        "",
        *([f"FAMILY = {art.family!r}  # the pool family (--family) it was found on"] if plugin else []),
        f"CONFIG = {art.config!r}",
        "# Catalogue faults the failure was found with; the family without them is the fixed one.",
        f"FAULTS = {list(art.faults)!r}",
        f"BACKUP_MODE = {art.backup_mode!r}",
        "DEVICE = os.environ.get(\"POOLFUZZ_DEVICE\", \"cpu\")",
        "",
        "",
        f"def {name}():",
        "    engine = Engine(config=get_config(CONFIG), device=DEVICE, faults=FAULTS, backup_mode=BACKUP_MODE,",
        f"                    options=EngineOptions({_kwargs(options)})"
        + (", family_factory=resolve_family(FAMILY).factory)" if plugin else ")"),
    ]
    failing_step = None if art.in_teardown else len(art.program)
    for i, step in enumerate(art.program, 1):
        call = f"    engine.{step.op}({_kwargs(step.args)})"
        comment = f"  # {step.outcome}" if step.outcome and not step.outcome.startswith("raised ") else ""
        if i == failing_step and step.outcome.startswith("raised "):
            comment = f"  # failed here: {_short(art.failure)}"
        lines.append(call + comment)
        check = "    engine.check()"
        if i == failing_step and not step.outcome.startswith("raised "):
            check += f"  # failed here: {_short(art.failure)}"
        lines.append(check)
    lines.append("    # teardown: every live slot checked once more, then every request ends and no pool may leak")
    lines.append("    engine.sweep()" + (f"  # failed here: {_short(art.failure)}" if art.in_teardown else ""))
    lines.append("    engine.drain()")
    return "\n".join(lines) + "\n"


def _kwargs(args: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _wrap(text: str, indent: str, width: int = 96) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent]
