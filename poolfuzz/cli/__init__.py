"""The ``poolfuzz`` command line: one argparse parser, a module per command that registers itself."""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys

from poolfuzz.errors import ConfigError, EngineApiChanged, UsageError

# Each module defines ``register(subparsers)`` which adds its parser and sets ``handler``.
COMMAND_MODULES = [
    "poolfuzz.cli.run",
    "poolfuzz.cli.catalogue",
    "poolfuzz.cli.bench",
    "poolfuzz.cli.hunt",
    "poolfuzz.cli.replay",
    "poolfuzz.cli.emit",
    "poolfuzz.cli.shortest",
    "poolfuzz.cli.doctor",
]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that names the problem and where to look, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="poolfuzz", description="Property-based fuzzing of LLM serving memory pools.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def run_cli(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage error (or --help)
        return 2 if exc.code else 0
    try:
        return args.handler(args)
    except (UsageError, ConfigError) as exc:
        print(f"poolfuzz: error: {exc}", file=sys.stderr)
        return 2
    except EngineApiChanged as exc:  # the installed engine lacks what the family reads: untested, not failed
        print(f"poolfuzz: {exc.verdict}", file=sys.stderr)
        return 2


class _PipeSafe:
    """stdout that outlives its reader (``poolfuzz replay FILE | head``): once the pipe is closed,
    output goes to /dev/null and the command runs on to its verdict, so the exit status still
    says whether the failure reproduced, with no BrokenPipeError traceback."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:  # also what the interpreter flushes at exit
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _silence_native_teardown() -> None:
    """At exit, after the run has said everything: Triton's native module (loaded where an engine's kernels run in its
    interpreter) reports its own objects as leaked while the interpreter finalizes, a hundred lines of nanobind
    noise on stderr that say nothing about the run. Its stderr is closed for that last stage only. The price: an exit
    handler registered before the run (a library's) that fails then fails silently too."""
    if "triton._C.libtriton" not in sys.modules:
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line itself (tests call main with their argv and keep their stderr)
        atexit.register(_silence_native_teardown)
    stdout = sys.stdout
    sys.stdout = _PipeSafe(stdout)
    try:
        return run_cli(sys.argv[1:] if argv is None else argv)
    finally:
        sys.stdout = stdout
