"""Subcommand modules; each has `register(subparsers)` and sets `handler` on its parsers."""

from grpod.daemon.commands import config, drill, export, forensics, plot, run, status

COMMAND_MODULES = [run, forensics, config, status, plot, drill, export]
