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


# The files that take longest in the gate (its --durations, 2026-12-03), run first: under
# `--dist loadfile` a file is one unit of work, and a long one started last leaves the other
# worker idle at the end (the longest-first rule for two machines)
LONGEST_FILES = (
    "tests/vllm/test_server_torchrun.py",  # `make test-vllm`'s three longest
    "tests/vllm/test_server.py",
    "tests/vllm/test_daemon.py",
    "tests/daemon/test_torchrun.py",
    "tests/daemon/test_real_model.py",
    "tests/daemon/test_incident_attribution.py",
    "tests/daemon/test_secrets.py",
    "tests/scripts/test_gpu_check.py",
    "tests/daemon/test_service.py",
    "tests/daemon/test_foreign_run_dirs.py",
    "tests/forensics/test_replay_threads.py",
    "tests/daemon/test_own_model.py",
    "tests/dashboards/test_scrape.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests of LONGEST_FILES first, in that order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
