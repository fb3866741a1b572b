"""The suite's own rule (tests/conftest.py): a test that starts a daemon or a launcher is
marked `slow`, or it fails; a `grpod run` refused for its input (exit 2) started nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import process_kind

ROOT = Path(__file__).resolve().parents[1]

INNER = """
import subprocess
import pytest

FAKE = {fake!r}


def test_unmarked_launcher():
    subprocess.run([FAKE + "/torchrun", "--standalone"], check=True)


@pytest.mark.slow
def test_marked_launcher():
    subprocess.run([FAKE + "/torchrun", "--standalone"], check=True)


def test_unmarked_daemon_that_ran():
    subprocess.run([FAKE + "/grpod", "run", "--max-steps", "1"], check=True)


def test_unmarked_daemon_refused_its_input():
    assert subprocess.run([FAKE + "/grpod", "run", "--bad"]).returncode == 2


def test_unmarked_other_grpod_command():
    subprocess.run([FAKE + "/grpod", "status"], check=True)
"""


def test_process_kinds() -> None:
    assert process_kind(["/x/.venv/bin/grpod", "run", "--config", "c.toml"]) == "daemon"
    assert process_kind(["/x/.venv/bin/grpod", "replay", "--step", "1"]) is None
    assert process_kind(["torchrun", "--standalone", "grpod"]) == "launcher"
    assert process_kind(["/v/bin/accelerate", "launch", "w.py"]) == "launcher"
    assert process_kind([sys.executable, "-m", "torch.distributed.run", "x"]) == "launcher"
    assert process_kind([sys.executable, "-m", "pytest"]) is None
    assert process_kind("torchrun --standalone x") == "launcher"
    assert process_kind([]) is None


def test_an_unmarked_test_that_starts_a_daemon_or_launcher_fails(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("torchrun", "exit 0"), ("grpod", '[ "$2" = --bad ] && exit 2; exit 0')):
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_call  # noqa: F401\n"
    )
    (inner / "test_inner.py").write_text(INNER.format(fake=str(fake)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(inner), "-p", "no:cacheprovider", "-q", "-rA",
         "-o", "addopts=", "-m", ""],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    failed = sorted(line.split("::")[1].split()[0] for line in lines if line.startswith("FAILED"))
    passed = sorted(line.split("::")[1].split()[0] for line in lines if line.startswith("PASSED"))
    assert failed == ["test_unmarked_daemon_that_ran", "test_unmarked_launcher"], done.stdout
    assert passed == [
        "test_marked_launcher",
        "test_unmarked_daemon_refused_its_input",
        "test_unmarked_other_grpod_command",
    ]
    assert "starts a launcher: mark it @pytest.mark.slow" in done.stdout
    assert "starts a daemon: mark it @pytest.mark.slow" in done.stdout
