"""The `grpod` command: one parser, subcommands registered by each area's module.

Errors of every package (`EngineError`, `GuardsError`, `ForensicsError`, `ConfigError`) are
caught once here: one line on stderr, exit code 2. Exit codes are documented in the README.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from grpod.base.fileio import private_umask
from grpod.base.oneline import say
from grpod.daemon.exitcodes import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an argument error is one line like every other refusal (exit 2), not
    its usage block; subcommands' parsers are of this class too (add_subparsers' default)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from grpod.daemon.commands import COMMAND_MODULES

    parser = OneLineParser(prog="grpod", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `grpod` console script."""
    from grpod.daemon.errors import BAD_INPUT_ERRORS

    parser = build_parser()
    args = parser.parse_args(argv)
    private_umask()  # run dirs, stores, exports: never readable by other users
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return code
    except BAD_INPUT_ERRORS as exc:
        say(f"grpod {args.command}: error: {exc}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `grpod incidents show 3 | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # not the input's (a full disk during export): one line, exit 1
        where = f" ({exc.filename})" if exc.filename else ""
        say(f"grpod {args.command}: error: {exc.strerror or exc}{where}")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
