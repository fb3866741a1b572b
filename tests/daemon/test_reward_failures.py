"""A reward that fails mid-run is the input's fault, as a user meets it: a real reward module
that raises on its Nth call, a held-out set the reward cannot parse, and one that hangs past
`reward_timeout_seconds`, each under a real `grpod run` subprocess."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.daemon.helpers import Grpod, write_config

pytestmark = pytest.mark.slow

# calls are counted in the process (preflight's one call included); eval calls (answer "?")
# raise or hang instead: a held-out row the reward cannot parse
REWARDS = """\
import os
import time

import numpy as np
import torch

CALLS = [0]


def nth(prompt, completion, answer):
    if answer == "?":
        if os.environ.get("EVAL_HANGS"):
            time.sleep(60)
        raise ValueError(f"cannot parse answer {answer!r}")
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("FAIL_AT", "0")):
        raise RuntimeError(f"call {CALLS[0]}: cannot score {completion!r}")
    return np.float32(completion[:1] == answer[:1])  # numpy's float32: a real number


def tensor(prompt, completion, answer):
    return torch.tensor(0.5, dtype=torch.float64)  # a 0-d tensor: a real number
"""

FAIL_STEP = 5  # its second sample: preflight's call + 5 steps x 4 samples + 2
FAIL_AT = 1 + FAIL_STEP * 4 + 2


def campaign(where: Path, **engine: object) -> Path:
    (where / "failing.py").write_text(REWARDS)
    (where / "heldout.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"{a}+1=", "answer": "?"}) for a in range(2)) + "\n"
    )
    return write_config(
        where / "grpod.toml",
        {
            "engine": {
                "task": "copy",
                "rewards": ["failing:nth", "failing:tensor"],
                "prompts_per_step": 2,
                "group_size": 2,
                "micro_batch_rows": 2,
                "seq_len": 16,
                "max_new_tokens": 2,
                "threads": 1,
                "eval_task": "heldout.jsonl",
                "eval_every": 2,
                "eval_samples": 2,
                **engine,
            },
            "daemon": {
                "metrics": False,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": 2,
            },
        },
    )


def test_a_reward_raising_mid_run_stops_with_exit_2_and_an_incident(tmp_path: Path) -> None:
    config = campaign(tmp_path)
    run = Grpod(["--config", str(config), "--run-dir", "run"], tmp_path, {"FAIL_AT": str(FAIL_AT)})
    assert run.wait() == 2, run.stderr
    # one line on stderr naming the step, the function, the prompt and the exception
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"grpod run: error: step {FAIL_STEP}: task copy: reward failing:nth")
    assert f"call {FAIL_AT}: cannot score" in lines[0] and "(prompt '" in lines[0]
    assert "RuntimeError" in lines[0]
    # a failing eval did not stop training: stored as failed, WARNed, training went on
    failed = [e for e in run.events if e["event"] == "eval failed"]
    assert [e["level"] for e in failed] == ["warning", "warning"]
    assert "reward failing:nth raised on sample 0" in failed[0]["error"]
    steps = [e["step"] for e in run.steps()]
    assert steps == list(range(FAIL_STEP + 1))
    assert run.steps()[0]["rewards"]["failing:tensor"]["mean"] == 0.5
    db = sqlite3.connect(tmp_path / "run" / "grpod.sqlite")
    evals = db.execute("SELECT step, samples, rewards_json FROM evals ORDER BY step").fetchall()
    assert [(s, n) for s, n, _ in evals] == [(2, 0), (4, 0)]
    assert json.loads(evals[0][2])["total"] == "nan"
    # the step in flight is not trained on; its samples are kept under an incident, and the
    # state before it is checkpointed
    outcome, verdict = db.execute(
        "SELECT outcome, verdict_action FROM steps WHERE step = ?", (FAIL_STEP,)
    ).fetchone()
    assert (outcome, verdict) == ("skipped", "HALT")
    guard, kind, step, checkpoint = db.execute(
        "SELECT i.guard, i.kind, i.step, c.step FROM incidents i "
        "JOIN checkpoints c ON c.id = i.checkpoint_id WHERE i.guard = 'reward'"
    ).fetchone()
    assert (guard, kind, step, checkpoint) == ("reward", "failed", FAIL_STEP, FAIL_STEP - 1)
    db.close()
    assert (tmp_path / "run" / "checkpoints" / f"step-{FAIL_STEP:08d}").is_dir()
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("refused", 2)
    # fixed (no failure now), the run resumes at the failed step: its prompts are not lost
    resumed = Grpod(["--run-dir", "run", "--max-steps", str(FAIL_STEP + 1)], tmp_path)
    assert resumed.wait() == 0, resumed.stderr
    assert [(e["step"], e.get("rerun", False)) for e in resumed.steps()] == [(FAIL_STEP, True)]


def test_a_hanging_eval_reward_stops_when_configured(tmp_path: Path) -> None:
    config = campaign(tmp_path, eval_on_error="stop", reward_timeout_seconds=0.5)
    run = Grpod(["--config", str(config), "--run-dir", "run"], tmp_path, {"EVAL_HANGS": "1"})
    assert run.wait() == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"grpod run: error: eval at step 2: task {tmp_path / 'heldout.jsonl'}: reward "
        "failing:nth took longer than reward_timeout_seconds 0.5 on sample 0 (prompt '0+1=')"
    ]
    assert [e["step"] for e in run.steps()] == [0, 1]
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()
