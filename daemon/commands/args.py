"""Argument types shared by the subcommands: a bad value is argparse's one line, exit 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def non_negative(kind: type) -> Callable[[str], int | float]:
    """An argparse `type=` that parses `kind` (int or float) and refuses values below 0."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
        return value

    parse.__name__ = kind.__name__
    return parse
