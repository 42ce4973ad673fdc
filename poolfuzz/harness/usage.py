"""One-line argument errors for a subcommand's parser (argparse prints the whole usage otherwise)."""

from __future__ import annotations

import sys
import types


def one_line_errors(parser) -> None:
    """Make ``parser.error`` print ``poolfuzz CMD: error: MESSAGE; see poolfuzz CMD --help`` and exit 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}; see {self.prog} --help\n")
        sys.exit(2)

    parser.error = types.MethodType(error, parser)
