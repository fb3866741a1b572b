"""Fixtures shared by the engine tests: the stand-in vLLM server (test_rollout_server.py), and
a directory on a disk (test_shared_weights.py, test_rollout_server.py)."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpod.engine.rollout.shared_weights import in_memory
from tests.engine.rollout.test_rollout_server import stand_in  # noqa: F401

VAR = Path(__file__).resolve().parents[2] / "var"  # the checkout's own (git-ignored) var/


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A new directory on a disk (in the checkout's var/: a machine's /tmp may be a tmpfs)."""
    VAR.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="test-disk-", dir=VAR))
    if in_memory(path):
        shutil.rmtree(path)
        pytest.fail(f"{VAR} is on a filesystem in memory: these tests need one on a disk")
    yield path
    shutil.rmtree(path, ignore_errors=True)
