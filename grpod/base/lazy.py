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
from pathlib import Path
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """`package`'s `__all__` (the names of `where`, sorted) and a module `__getattr__` that
    imports `name` from module `where[name]`:

        __all__, __getattr__ = lazy_exports(__name__, {"Engine": "grpod.engine.grpo.trainer"})

    An exported name may not also be a submodule's: importing `package.name` binds the
    package's attribute to the module, and the export would then read as the module or the
    function by import order (`grpod.forensics.replay` once did: the module is step_replay)."""
    spec = sys.modules[package].__spec__
    for name in where:
        if spec is not None and spec.submodule_search_locations is not None:
            for folder in spec.submodule_search_locations:
                if any((Path(folder) / f"{name}{suffix}").exists() for suffix in ("", ".py")):
                    raise ImportError(f"{package}: export {name!r} is also a submodule's name")

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(where[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return sorted(where), __getattr__
