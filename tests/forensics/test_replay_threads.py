"""A step recorded by `grpod run` at OMP_NUM_THREADS=2 replays bit-exactly from shells at 1
and 4 threads: the step's record carries its thread count and `grpod replay` sets it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.helpers import cli, run_to_end
from tests.daemon.ownmodel import user_campaign
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow

REWARD = """
def parity(prompt, completion, answer):
    return float(sum(map(ord, completion)) % 2)
"""


def torch_threads(omp_num_threads: int) -> int:
    """torch's intra-op threads in a process started with OMP_NUM_THREADS (torch takes no
    more than the machine's cores)."""
    probe = "import torch; print(torch.get_num_threads())"
    env = {"OMP_NUM_THREADS": str(omp_num_threads), "PATH": ""}
    return int(subprocess.check_output([sys.executable, "-c", probe], env=env, text=True))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps of a 256-wide random-init model, recorded at 2 threads (config: leave as is)."""
    where = tmp_path_factory.mktemp("threads")
    model = build_hf_dir(where / "model", hidden_size=256)
    config = user_campaign(
        where, model, threads=0, reward="myrewards:parity", group_size=4, max_new_tokens=4
    )
    (where / "myrewards.py").write_text(REWARD)
    config.write_text(config.read_text() + "\n[forensics]\nkeep_checkpoints = 0\n")
    run_to_end(["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3"], where,
               {"OMP_NUM_THREADS": "2"})  # fmt: skip
    return where


@pytest.mark.parametrize("threads", [1, 4])
def test_a_step_recorded_at_2_threads_replays_bit_exactly_at(work: Path, threads: int) -> None:
    env = {"OMP_NUM_THREADS": str(threads)}
    done = cli("replay", "--run-dir", "run", "--step", "1", "--json", cwd=work, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["reproduced"] is True and result["classification"] == "healthy", result
    assert result["steps_replayed"] == 2 and result["diverged_at"] is None
    recorded, shell = torch_threads(2), torch_threads(threads)
    restored = {"threads": {"recorded": recorded, "shell": shell}} if shell != recorded else {}
    assert result["context"]["restored"] == restored
    assert result["context"]["recorded"] is True
    assert not [d for d in result["context"]["differs"] if d["decides"]], result["context"]
    text = cli("replay", "--run-dir", "run", "--step", "1", cwd=work, env=env)
    assert text.returncode == 0, text.stderr[-2000:]
    assert text.stdout.startswith("step 1: reproduced (healthy)\n"), text.stdout
    if restored:
        assert f"context restored: threads {recorded} (the shell's {shell})" in text.stdout
