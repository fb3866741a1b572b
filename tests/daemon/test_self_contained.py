"""A run dir is self-contained: replay from any working directory (the task and the reward
module were found from the run's cwd), and a task changed since the run is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon.helpers import cli, run_to_end, write_config

pytestmark = pytest.mark.slow


def test_replay_from_another_cwd_and_a_changed_task_is_named(tmp_path: Path) -> None:
    where = tmp_path / "campaign"
    (where / "data").mkdir(parents=True)
    task = where / "data" / "train.jsonl"
    task.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a)}) + "\n" for a in range(8))
    )
    (where / "myrewards.py").write_text("def first(p, c, a):\n    return float(c[:1] == a[:1])\n")
    engine = {"task": "data/train.jsonl", "reward": "myrewards:first", "prompts_per_step": 2,
              "group_size": 2, "micro_batch_rows": 2, "seq_len": 16, "max_new_tokens": 2,
              "threads": 1}  # fmt: skip
    daemon = {"metrics": False, "log_format": "json", "progress": "off", "checkpoint_every": 2}
    config = write_config(where / "grpod.toml", {"engine": engine, "daemon": daemon})
    run_to_end(["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3"], where)
    recorded = (where / "run" / "config.toml").read_text()
    assert f'task = "{task}"' in recorded and f'reward_path = "{where}"' in recorded
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = cli("replay", "--run-dir", str(where / "run"), "--step", "2", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("step 2: reproduced")
    task.write_text(task.read_text() + json.dumps({"prompt": "9+1=", "answer": "0"}) + "\n")
    done = cli("replay", "--run-dir", str(where / "run"), "--step", "2", cwd=elsewhere)
    assert done.returncode == 2
    assert done.stderr.startswith(f"grpod replay: error: run dir {where / 'run'}: {task} changed")
    assert len(done.stderr.splitlines()) == 1
    assert config.is_file()
