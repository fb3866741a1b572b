"""The systemd unit: the directives the daemon relies on, and its hardening score."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from grpod import daemon

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

UNIT = Path(daemon.__file__).with_name("systemd") / "grpod.service"


def _directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_unit_directives() -> None:
    unit = _directives()
    assert unit["Type"] == ["notify"] and unit["Restart"] == ["on-failure"]
    assert "3" in unit["RestartPreventExitStatus"][0].split()  # HALT: a person looks first
    assert "2" in unit["RestartPreventExitStatus"][0].split()  # bad config: never loops
    assert unit["WatchdogSec"] and unit["TimeoutStopSec"] and unit["User"] == ["grpod"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"] and unit["ReadWritePaths"] == ["/var/lib/grpod"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_security_exposure_is_low() -> None:
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for grpod\.service: ([0-9.]+)", out.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze has no --offline here: {out.stderr.strip()[:200]}")
    assert float(match.group(1)) <= 2.0, out.stdout
