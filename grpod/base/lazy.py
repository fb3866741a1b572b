"""Package attributes imported on first use (PEP 562), shared by grpod's package `__init__`s.

`grpod.engine`, `grpod.guards` and `grpod.forensics` export their public names lazily so
that importing one light submodule (`grpod.engine.errors`, a config model) does not import
torch, transformers and SQLAlchemy: a `grpod` command that only parses its arguments or a
config file answers in a fraction of a second.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `name` from module `where[name]`."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(where[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
