"""End-to-end: a tiny campaign over an 8-prompt task (an epoch is 4 steps), with flushed steps
and async steps (max_staleness 1) whose stale rollouts are dropped, SIGKILLed inside a step
and resumed twice: `grpod fsck`'s ledger accounts for every prompt of its 3 epochs once."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.daemon.helpers import Grpod, cli, free_port, run_to_end, tiny_config, wait_until
from tests.daemon.stepgate import ENV, SPEC, StepGate

pytestmark = pytest.mark.slow
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a)} for a, b in zip(range(8), range(7, -1, -1))]
PER_STEP, GROUP = 2, 4
EPOCH_STEPS = len(PROMPTS) // PER_STEP  # 4
STEPS = 3 * EPOCH_STEPS
FLUSHED = [2, 7]  # a NaN loss: the nonfinite guard flushes the step
STALE = [5, 11]  # launched a step early: dropped as too stale, sampled again


def ledger_rows(run_dir: Path, where: str = "1") -> list[tuple]:
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        columns = "step, prompt_id, fate, stale_drops, superseded"
        return db.execute(f"SELECT {columns} FROM prompt_ledger WHERE {where}").fetchall()


def killed_in(args: list[str], cwd: Path, run_dir: Path, start: int, step: int) -> None:
    """A run from `start` held in step `step` once the steps before it are committed, then
    SIGKILLed there (its rows of the steps past the last checkpoint are left behind)."""
    gate = StepGate(cwd / f"gate-{step}", step - start, PER_STEP * GROUP)
    g = Grpod(args, cwd, gate.env)
    gate.wait_held(g.alive)
    wait_until(
        lambda: (
            max((s for s, *_ in ledger_rows(run_dir, "superseded = 0")), default=-1) >= step - 1
        ),
        f"steps before {step} committed",
        g.alive,
    )
    g.signal(signal.SIGKILL)
    assert g.wait() == -signal.SIGKILL


def test_killed_and_resumed_twice_every_prompt_is_counted_once(tmp_path: Path) -> None:
    task = tmp_path / "eight.jsonl"
    task.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    engine = {
        "task": str(task),
        "rewards": [SPEC],  # the step gate's hold point
        "prompts_per_step": PER_STEP,
        "group_size": GROUP,
        "max_staleness": 1,
        "tis_cap": 2.0,
        "faults": {"nan_loss_steps": FLUSHED, "stale_rollout_steps": STALE},
    }
    config = tiny_config(tmp_path / "grpod.toml", free_port(), engine, checkpoint_every=4)
    run_dir = tmp_path / "run"
    args = ["--config", str(config), "--run-dir", "run", "--max-steps", str(STEPS)]

    killed_in(args, tmp_path, run_dir, 0, 6)  # checkpoints 0 and 4; steps 0-5 recorded
    killed_in(args, tmp_path, run_dir, 4, 10)  # resumed from 4: 4 and 5 re-run; 8 saved
    last = run_to_end(args, tmp_path, ENV)
    assert last.event("started")["resumed_from"] == 8

    fsck = cli("fsck", "--run-dir", "run", "--json", cwd=tmp_path)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    ledger = json.loads(fsck.stdout)["ledger"]
    assert ledger["checked"] and ledger["last_step"] == STEPS - 1
    assert ledger["missing"] == [] and ledger["duplicated"] == []
    assert sorted(ledger["epochs"]) == ["0", "1", "2"]
    for counts in ledger["epochs"].values():
        assert counts["size"] == counts["prompts"] == len(PROMPTS) and counts["complete"]
    fates = [e["fates"] for e in ledger["epochs"].values()]
    assert sum(f.get("flushed", 0) for f in fates) == PER_STEP * len(FLUSHED)
    assert sum(sum(f.values()) for f in fates) == PER_STEP * STEPS
    assert ledger["superseded_rows"] >= PER_STEP * 4  # steps 4, 5, 8 and 9 at least

    live = ledger_rows(run_dir, "superseded = 0")
    assert sorted({step for step, _, fate, *_ in live if fate == "flushed"}) == FLUSHED
    # step 5's drop is in its superseded rows: its re-run after the resume sampled in time
    assert {step for step, _, _, drops, _ in live if drops} == {11}
    assert {step for step, _, _, drops, _ in ledger_rows(run_dir) if drops} == {5, 11}

    status = cli("status", "--run-dir", "run", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"ledger through step {STEPS - 1}: epoch 0 8/8 prompts" in status.stdout
