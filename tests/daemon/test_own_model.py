"""A user's own HF model, JSONL task and reward module (found from the working directory):
`grpod run` with progress on and stdout piped keeps its JSON step events; replay from the same
directory reproduces a step."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import GRPOD, run_to_end
from tests.daemon.ownmodel import user_campaign
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow


def test_own_model_task_and_reward_run_and_replay(tmp_path: Path) -> None:
    model = build_hf_dir(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    config = user_campaign(work, model)
    text = config.read_text().replace("[daemon]\n", '[daemon]\nprogress = "on"\n')
    config.write_text(text)
    env = {"PYTHONPATH": os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", "")] if p)}
    run = run_to_end(["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3"], work, env)
    steps = run.steps()  # stdout is a pipe: the step events stay beside the progress bar
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert all(0.0 <= e["reward_mean"] <= 1.0 for e in steps)
    assert "reward 0." in run.stderr  # the bar went to stderr
    done = subprocess.run(
        [GRPOD, "replay", "--run-dir", "run", "--step", "2", "--json"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["reproduced"] is True and result["step"] == 2
