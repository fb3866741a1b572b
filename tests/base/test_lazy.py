"""grpod.base.lazy: an exported name that is also a submodule's is refused when the package
is defined (it would read as the module or the function by import order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _package(root: Path, name: str, exports: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(
        "from grpod.base.lazy import lazy_exports\n"
        f"__all__, __getattr__ = lazy_exports(__name__, {exports})\n"
    )
    (root / name / "work.py").write_text("def work():\n    return 'the function'\n")


def test_an_export_named_like_a_submodule_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _package(tmp_path, "lazy_clash", "{'work': 'lazy_clash.work'}")
    with pytest.raises(ImportError, match="export 'work' is also a submodule's name"):
        __import__("lazy_clash")
    _package(tmp_path, "lazy_fine", "{'run': 'lazy_fine.work'}")
    (tmp_path / "lazy_fine" / "work.py").write_text("def run():\n    return 'the function'\n")
    import lazy_fine
    import lazy_fine.work

    assert lazy_fine.run() == "the function"
    for name in [n for n in sys.modules if n.startswith(("lazy_clash", "lazy_fine"))]:
        del sys.modules[name]


def test_grpods_own_exports_read_as_what_they_name() -> None:
    import grpod.forensics.step_replay  # noqa: F401  (a submodule imported first)
    from grpod.forensics import replay

    assert callable(replay) and replay.__module__ == "grpod.forensics.step_replay"
