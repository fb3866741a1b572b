"""Two gloo processes on CPU: a NaN on rank 1 only makes both ranks flush the step."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_nan_on_rank_1_flushes_the_step_on_both_ranks() -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.guards.dist_worker"],
            cwd=ROOT,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        line = json.loads(out.strip().splitlines()[-1])
        results[line["rank"]] = line
    for rank in (0, 1):
        steps = results[rank]["steps"]
        assert [s["outcome"] for s in steps] == ["applied", "flushed", "applied"]
        assert steps[1]["untouched"] is True
        assert results[rank]["skip"] is True
    guards = results[1]["steps"][1]["guards"]  # loss and micro loss, and the grad norm if hit
    assert set(guards) == {"finite"} and len(guards) >= 2
    assert results[0]["steps"][1]["guards"] == ["policy"]  # a peer rank's verdict
    assert results[1]["skip_guards"] == ["reorder"]
    assert results[0]["skip_guards"] == ["policy"]
