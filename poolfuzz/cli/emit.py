"""``poolfuzz emit-test FILE -o PATH``: turn a failure artifact into a standalone pytest module.

The module builds the family and runs the shrunk program as plain engine calls, each followed by
``engine.check()``, which asserts that every component of every touched request survived. It
fails while the bug is present and passes once it is fixed.
"""

from __future__ import annotations


import ast
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
    p.add_argument("--force", action="store_true", help="overwrite PATH if it exists (default: refuse)")
    p.add_argument("--family", metavar="NAME|module:factory",
                   help="trust this pool family: an artifact that names a module:factory (not an installed "
                        "plug-in) is emitted only when it is passed here, since a file never chooses code to run")
    p.set_defaults(handler=main)


def main(args, out=None) -> int:
    from poolfuzz.orchestration import artifacts
    from poolfuzz.errors import UsageError

    out = out or sys.stdout
    # what cannot replay here (or names a family the user did not trust): one line, exit 2, nothing written
    art = artifacts.load_checked(args.file, trusted_family=args.family)[0]
    out.write(artifacts.renamed_note(art))
    path = Path(args.output)
    if path.is_dir():
        raise UsageError(f"-o {args.output!r} is a directory; name the file, e.g. "
                         f"{path / f'test_regression_{slug(art.config)}.py'}")
    if path.suffix != ".py":
        raise UsageError(f"-o {args.output!r} must name a .py file (pytest collects test_*.py); "
                         f"for example -o test_regression_{slug(art.config)}.py")
    if not path.parent.is_dir():
        raise UsageError(f"-o {args.output!r}: the directory {str(path.parent)!r} does not exist; create it first")
    if path.exists() and not args.force:
        raise UsageError(f"-o {args.output!r} exists; pass --force to overwrite it, or name another file")
    write = render_scheduled if artifacts.is_scheduler_program(art) else render
    source = write(art, source_name=os.path.basename(str(args.file)))
    compile(source, str(path), "exec")  # never write a module that does not parse
    try:
        artifacts.write_text_atomic(path, source)
    except OSError as exc:
        raise UsageError(f"cannot write -o {args.output!r} ({exc.strerror or exc}); pick a folder you can "
                         "write to") from None
    out.write(f"wrote {path}: {len(art.program)} steps on {art.config}"
              + (f" with {', '.join(art.faults)}" if art.faults else "")
              + f"; run it with: python -m pytest {path}\n")
    if not path.name.startswith("test_"):
        out.write(f"note: pytest collects test_*.py files by default; name it test_{path.name} to have it collected\n")
    return 0


def render(art, *, source_name: str = "") -> str:
    """The test module's source.

    Every artifact value is untrusted text. It reaches the module as a Python literal (``repr``),
    in the docstring through :func:`_docstring` or in a comment through :func:`_comment`: no value
    can end a string or a comment and add a statement.
    """
    from poolfuzz.orchestration.artifacts import engine_options

    options = engine_options(art, source_name or "artifact")
    kind = (art.divergence or {}).get("kind") or art.error_type
    plugin = art.family != "builtin"
    op = (art.divergence or {}).get("op") or "teardown"
    name = f"test_{slug(art.config)}_{slug(kind)}_at_{slug(op)}"
    imports, config, expr = _config_lines(art)
    lines = [
        *_header(art, source_name, [
            "Each step is one engine operation on a real pool family (a prefill and a decode node) and its",
            "reference model; engine.check() after it compares every component of every request the step",
            "touched, slot by slot, and raises StateLost / InvariantViolation / ReferenceMismatch naming",
            "whose data is where. The test fails while the bug is present and passes once it is fixed.",
        ]),
        "import os",
        "",
        "from poolfuzz.harness.engine import Engine, EngineOptions",
        *(["from poolfuzz.orchestration.plugins import resolve_family"] if plugin else []),
        *imports,
        "",
        *([f"FAMILY = {art.family!r}  # the pool family (--family) it was found on"] if plugin else []),
        *config,
        "# Catalogue faults the failure was found with; the family without them is the fixed one.",
        f"FAULTS = {list(art.faults)!r}",
        f"BACKUP_MODE = {art.backup_mode!r}",
        "DEVICE = os.environ.get(\"POOLFUZZ_DEVICE\", \"cpu\")",
        "",
        "",
        f"def {name}():",
        f"    engine = Engine(config={expr}, device=DEVICE, faults=FAULTS, backup_mode=BACKUP_MODE,",
        f"                    options=EngineOptions({_kwargs(options)})"
        + (", family_factory=resolve_family(FAMILY).factory)" if plugin else ")"),
    ]
    failing_step = None if art.in_teardown else len(art.program)
    for i, step in enumerate(art.program, 1):
        call = f"    engine.{step.op}({_kwargs(step.args)})"
        comment = _comment(step.outcome) if step.outcome and not step.outcome.startswith("raised ") else ""
        if i == failing_step and step.outcome.startswith("raised "):
            comment = _comment(f"failed here: {_short(art.failure)}")
        lines.append(call + comment)
        check = "    engine.check()"
        if i == failing_step and not step.outcome.startswith("raised "):
            check += _comment(f"failed here: {_short(art.failure)}")
        lines.append(check)
    lines.append("    # teardown: every live slot checked once more, then every request ends and no pool may leak")
    lines.append("    engine.sweep()" + (_comment(f"failed here: {_short(art.failure)}") if art.in_teardown else ""))
    lines.append("    engine.drain()")
    return "\n".join(lines) + "\n"


def _header(art, source_name: str, how: list[str]) -> list[str]:
    doc = [
        "Regression test from a shrunk poolfuzz failure.",
        "",
        f"Recorded on {art.device} ({art.status}) with poolfuzz {art.poolfuzz_version or '?'}, "
        f"Hypothesis {art.hypothesis_version or '?'}" + (f", from {source_name}" if source_name else "") + ":",
        "",
        *_wrap(art.failure, "    "),
        "",
        *how,
        "",
    ]
    return [_docstring("\n".join(doc)), ""]


def _config_lines(art) -> tuple[list[str], list[str], str]:
    """The import, the CONFIG assignment and the expression of the config the failure was found on."""
    if art.model_config is None:
        return ["from poolfuzz.pools.config import get_config"], [f"CONFIG = {art.config!r}"], "get_config(CONFIG)"
    return (["from poolfuzz.pools.config_file import config_from_fields"],
            ["# The config it failed on (drawn, or from a config file), every field:",
             f"CONFIG = config_from_fields({_fields(art.model_config)}, 'the recorded config')"], "CONFIG")


def render_scheduled(art, *, source_name: str = "") -> str:
    """A scheduler program's test module: the engine's own scheduler on a fresh server, fed the same traffic.

    Untrusted values reach the module as in :func:`render`."""
    kind = (art.divergence or {}).get("kind") or art.error_type
    op = (art.divergence or {}).get("op") or "teardown"
    imports, config, expr = _config_lines(art)
    lines = [
        *_header(art, source_name, [
            "Each step is traffic for the engine's own scheduler: a request arrives, the scheduler runs steps",
            "(its worker stand-in checks, before every forward, that each position attended holds the request's",
            "own KV and its recurrent state is that of exactly its computed tokens), a request is aborted.",
            "server_state_agrees() after each compares what the worker stand-in and the engine's other observers",
            "(a KV-event mirror, the pool's accounting) hold with the scheduler's state; the teardown drains the",
            "server. It fails while the bug is present and passes once it is fixed.",
        ]),
        "from poolfuzz.harness.scheduled import scheduled_machine",
        "from poolfuzz.orchestration.plugins import resolve_family",
        *imports,
        "",
        f"FAMILY = {art.family!r}  # the family (--family) it was found on: the engine's scheduler, driven",
        f"BACKUP_MODE = {art.backup_mode!r}  # the retraction path the failing server ran",
        *config,
        "",
        "",
        f"def test_{slug(art.config)}_{slug(kind)}_at_{slug(op)}():",
        "    factory = resolve_family(FAMILY).factory",
        f"    machine = scheduled_machine({expr}, driver_factory=lambda c: factory(c, backup_mode=BACKUP_MODE))()",
    ]
    failing_step = None if art.in_teardown else len(art.program)
    for i, step in enumerate(art.program, 1):
        comment = _comment(f"failed here: {_short(art.failure)}") if i == failing_step else (
            _comment(step.outcome) if step.outcome else "")
        lines.append(f"    machine.{step.op.removeprefix('scheduler.')}({_kwargs(step.args)}){comment}")
        lines.append("    machine.server_state_agrees()")
    lines.append("    machine.teardown()" + (_comment(f"failed here: {_short(art.failure)}") if art.in_teardown
                                               else "  # every request finishes, no block is leaked"))
    return "\n".join(lines) + "\n"


def _fields(fields: dict) -> str:
    """The config's fields as one dict literal, a field a line (artifacts.load checked every value:
    ints, printable strings and lists of ints)."""
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in fields.items()) + "}"


def _kwargs(args: dict) -> str:
    # Keys are parameter names and values plain ints, lists and names: artifacts.load checked both.
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _comment(text: str) -> str:
    """``  # text`` on one line: printable text as it is (it cannot end the comment), anything else as
    its ``repr``, where a newline is the two characters backslash and n."""
    return f"  # {text if text.isprintable() else repr(text)}"


def _docstring(text: str) -> str:
    """A triple-quoted literal whose value is exactly ``text``: readable lines, every backslash and
    double quote escaped (so nothing in it can close the string), unprintable characters as escapes."""
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "\n" or ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # \x00, \r, \t, \u2028, a lone surrogate: never raw in the file
    literal = '"""' + "".join(out) + '"""'
    if ast.literal_eval(literal) != text:  # cannot happen; never write a module that says something else
        raise AssertionError(f"docstring escaping changed the text {text!r}")
    return literal


def _wrap(text: str, indent: str, width: int = 96) -> list[str]:
    import textwrap

    # Keep every character (tabs, carriage returns): the docstring quotes the failure as recorded.
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent,
                         expand_tabs=False, replace_whitespace=False) or [indent]
