"""The test PostgreSQL server's port: below the kernel's ephemeral range, where no outgoing
connection (a vLLM worker opens a dozen) can take it before the server binds it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral() -> tuple[int, int]:
    low, high = PORT_RANGE.read_text().split()
    return int(low), int(high)


def test_the_makefile_port_is_below_the_ephemeral_range() -> None:
    dry = subprocess.run(
        ["make", "-n", "-s", "postgres"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    port = int(re.search(r"pg_test_server\.sh start \S+ (\d+)", dry.stdout).group(1))
    assert port < _ephemeral()[0]


def test_the_server_script_refuses_an_ephemeral_port(tmp_path: Path) -> None:
    low, high = _ephemeral()
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/pg_test_server.sh"), "start", str(tmp_path / "pg"), str(low)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"pg_test_server: error: PORT {low} is inside the kernel's ephemeral range {low}-{high} "
        f"(ip_local_port_range): pick one below {low}"
    ]
    assert not (tmp_path / "pg").exists()
