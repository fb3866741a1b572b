"""`grpod config example` (the commented default grpod.toml) and `grpod config check FILE`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="the grpod.toml: print the example, check a file")
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    example = actions.add_parser("example", help="print every key with its default, commented")
    example.set_defaults(handler=_example)
    check = actions.add_parser("check", help="validate FILE (exit 2 with the key path if bad)")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(handler=_check)


def _example(args: argparse.Namespace) -> int:
    from grpod.daemon.example import example_toml

    print(example_toml(), end="")
    return 0


def _check(args: argparse.Namespace) -> int:
    from grpod.daemon.config import load_config

    load_config(args.file)  # ConfigError -> one line, exit 2
    print(f"{args.file}: ok")
    return 0
