"""`lint-imports` over grpod's layers (the contracts: pyproject.toml, `[tool.importlinter]`).

grpod's packages install under one namespace from several top-level directories
(`grpod.engine` from engine/, ...: pyproject.toml's package-dir), which import-linter's graph
builder cannot follow: it walks one directory per top-level package. So the source tree is
laid out as it installs, in a temporary directory (copies of the .py files only), and
`lint-imports` runs there with the repository's pyproject.toml. Exits with its status.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def lay_out(into: Path) -> None:
    """Every package of pyproject's package-dir mapping at its installed place under `into`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, where in sorted(config["package-dir"].items()):
        target = into.joinpath(*package.split("."))
        for source in (ROOT / where).rglob("*.py"):
            relative = source.relative_to(ROOT / where)
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target / relative)


def main() -> int:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="grpod-lint-imports-") as tmp:
        lay_out(Path(tmp))
        command = [str(lint_imports), str(ROOT / "pyproject.toml"), "--no-cache"]
        return subprocess.run([*command, *sys.argv[1:]], cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
