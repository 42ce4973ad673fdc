"""Command line entry: each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

from poolfuzz.pools.errors import ConfigError

# Each module defines ``register(subparsers)`` which adds its parser and sets ``handler``.
COMMAND_MODULES = [
    "poolfuzz.harness.run_command",
    "poolfuzz.harness.catalogue_command",
    "poolfuzz.harness.bench",
    "poolfuzz.harness.hunt",
    "poolfuzz.harness.replay_command",
    "poolfuzz.harness.emit_command",
]


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2, nothing written."""


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
