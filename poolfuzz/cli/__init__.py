"""The ``poolfuzz`` command line: one argparse parser, a module per command that registers itself."""

from __future__ import annotations

import argparse
import importlib
import sys

from poolfuzz.errors import ConfigError, UsageError

# Each module defines ``register(subparsers)`` which adds its parser and sets ``handler``.
COMMAND_MODULES = [
    "poolfuzz.cli.run",
    "poolfuzz.cli.catalogue",
    "poolfuzz.cli.bench",
    "poolfuzz.cli.hunt",
    "poolfuzz.cli.replay",
    "poolfuzz.cli.emit",
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


def main(argv: list[str] | None = None) -> int:
    return run_cli(sys.argv[1:] if argv is None else argv)
