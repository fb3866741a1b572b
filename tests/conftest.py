"""Shared test setup: few CPU threads (CI has 2 cores), deterministic torch, and the rule that
keeps `make test-fast` fast: a test that starts a daemon (`grpod run` that gets past its input
checks), torchrun or `accelerate launch` must be marked `slow`; unmarked, it fails and says so."""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torch.set_num_threads(1)
# and every process a test starts, unless the test says otherwise: the gate runs two tests at
# once on two cores, and torch's OpenMP threads spin when there are more than cores (a 20 s
# test took 320 s with two threads beside another worker)
os.environ["OMP_NUM_THREADS"] = "1"

LAUNCHERS = {"torchrun", "accelerate"}
LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
REFUSED = 2  # grpod's exit status for bad input: refused before anything ran


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def process_kind(args: Any) -> str | None:
    """'daemon', 'launcher' or None for a Popen argument list."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    if not argv:
        return None
    program = os.path.basename(argv[0].split()[0])
    if program == "grpod" and "run" in argv[1:2]:
        return "daemon"
    if program in LAUNCHERS or any(
        flag == "-m" and module in LAUNCHER_MODULES for flag, module in itertools.pairwise(argv)
    ):
        return "launcher"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    started: list[tuple[str, subprocess.Popen]] = []
    original = subprocess.Popen.__init__

    def recording(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        original(self, args, *rest, **kwargs)
        kind = process_kind(args)
        if kind:
            started.append((kind, self))

    subprocess.Popen.__init__ = recording  # type: ignore[method-assign]
    try:
        result = yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]
    ran = sorted({kind for kind, proc in started if kind != "daemon" or proc.poll() != REFUSED})
    if ran and item.get_closest_marker("slow") is None:
        pytest.fail(
            f"this test starts a {' and a '.join(ran)}: mark it @pytest.mark.slow "
            "(`make test-fast` leaves those out; tests/conftest.py)",
            pytrace=False,
        )
    return result
