"""The systemd units (one process, and a GPU node's ranks under grpod's agent): the directives
the daemon relies on, `systemd-analyze verify`, and the hardening score."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpod import daemon

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

UNITS = Path(daemon.__file__).with_name("systemd")
UNIT, GPU_UNIT = UNITS / "grpod.service", UNITS / "grpod-gpu.service"
GRPOD = str(Path(sys.executable).with_name("grpod"))
needs_systemd_analyze = pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="no systemd-analyze here"
)


def _directives(unit: Path = UNIT) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("path", [UNIT, GPU_UNIT], ids=lambda p: p.name)
def test_unit_directives(path: Path) -> None:
    unit = _directives(path)
    assert unit["Type"] == ["notify"] and unit["Restart"] == ["on-failure"]
    assert "3" in unit["RestartPreventExitStatus"][0].split()  # HALT: a person looks first
    assert "2" in unit["RestartPreventExitStatus"][0].split()  # bad config: never loops
    assert unit["WatchdogSec"] and unit["TimeoutStopSec"] and unit["User"] == ["grpod"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"] and unit["ReadWritePaths"] == ["/var/lib/grpod"]


def test_the_gpu_node_unit_runs_the_agent_and_keeps_notify_access_main() -> None:
    unit = _directives(GPU_UNIT)
    (command,) = unit["ExecStart"]
    assert command.split()[1:4] == ["run", "--nproc-per-node", "8"]
    assert unit["NotifyAccess"] == ["main"]  # the agent notifies for its ranks
    assert unit["KillMode"] == ["mixed"]  # SIGTERM to the agent alone: the ranks get one
    assert unit["RestartPreventExitStatus"] == ["2 3"]
    stop = unit["TimeoutStopSec"][0]
    assert stop.endswith("min") and int(stop[:-3]) >= 30  # a step and a checkpoint of 8 ranks
    # the rest is the one-process unit's (hardening, user, directories)
    same = {k: v for k, v in _directives(UNIT).items() if k not in unit or unit[k] == v}
    assert set(same) >= {"User", "ProtectSystem", "SystemCallFilter", "DeviceAllow"}


@needs_systemd_analyze
@pytest.mark.parametrize("path", [UNIT, GPU_UNIT], ids=lambda p: p.name)
def test_systemd_analyze_verifies_the_unit(path: Path, tmp_path: Path) -> None:
    """As installed: ExecStart's grpod is this environment's (verify checks it exists)."""
    unit = tmp_path / path.name
    unit.write_text(path.read_text().replace("/opt/grpod/.venv/bin/grpod", GRPOD))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and path.name not in done.stderr, done.stderr


@needs_systemd_analyze
@pytest.mark.parametrize("path", [UNIT, GPU_UNIT], ids=lambda p: p.name)
def test_security_exposure_is_low(path: Path) -> None:
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(rf"Overall exposure level for {re.escape(path.name)}: ([0-9.]+)", out.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze has no --offline here: {out.stderr.strip()[:200]}")
    assert float(match.group(1)) <= 2.0, out.stdout
