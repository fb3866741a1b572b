"""`grpod config example` (the commented default grpod.toml) and `grpod config check FILE`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="the grpod.toml: print the example, check a file")
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    example = actions.add_parser("example", help="print every key with its default, commented")
    example.set_defaults(handler=_example)
    check = actions.add_parser(
        "check", help="validate each FILE, its model, task and reward (exit 2 if any is bad)"
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(handler=_check)


def _example(args: argparse.Namespace) -> int:
    from grpod.daemon.example import example_toml

    print(example_toml(), end="")
    return 0


def _check(args: argparse.Namespace) -> int:
    """One line per file: `FILE: ok`, or the error naming the thing and the reason."""
    import sys

    from grpod.daemon.config import load_config
    from grpod.daemon.errors import BAD_INPUT_ERRORS
    from grpod.engine.grpo.preflight import preflight

    bad = 0
    for file in args.files:
        try:
            preflight(load_config(file).engine)  # model, tokenizer, prompts, reward
        except BAD_INPUT_ERRORS as exc:
            bad += 1
            where = "" if str(exc).startswith(f"{file}:") else f"{file}: "
            print(f"grpod config: error: {where}{exc}", file=sys.stderr)
            continue
        print(f"{file}: ok")
    return 2 if bad else 0
