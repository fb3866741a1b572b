"""Subcommand modules; each has `register(subparsers)` and sets `handler` on its parsers."""

from daemon.commands import run

COMMAND_MODULES = [run]
