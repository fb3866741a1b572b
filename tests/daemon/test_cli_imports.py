"""Commands that only parse arguments or a config file do not import torch (grpod/base/lazy.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
from grpod.daemon.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "sqlalchemy") if m in sys.modules)
print("HEAVY", ",".join(heavy), "RC", rc)
"""


def _probe(*argv: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("HEAVY"))
    _, heavy, _, rc = line.split(" ")
    return heavy, int(rc)


def test_config_check_and_example_load_no_torch() -> None:
    assert _probe("config", "check", "daemon/grpod.example.toml") == ("", 0)
    assert _probe("config", "check", "no/such/grpod.toml") == ("", 2)


def test_package_exports_still_resolve() -> None:
    from grpod import engine, forensics, guards

    for package in (engine, guards, forensics):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
