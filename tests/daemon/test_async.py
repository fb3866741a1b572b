"""`grpod run` with `max_staleness = 1` (async steps; the torch sampler samples at launch):
every trained batch's staleness is at most 1 in the store, the stale-rollout drill's batch is
dropped and counted (scraped), its step trains on a fresh batch, and `grpod replay` of an
async step is bit-exact from the recorded batch."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.daemon.helpers import Grpod, cli, free_port, http_get, parse_metrics, tiny_config

STEPS = 6
DRILL = 3  # its rollout is launched a step early: two versions old when step 3 comes


def stored_batches(run_dir: Path) -> dict[int, tuple[str, dict]]:
    """{step: (outcome, report)} from the store."""
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        rows = db.execute("SELECT step, outcome, report_json FROM steps ORDER BY id").fetchall()
    return {step: (outcome, json.loads(report)) for step, outcome, report in rows}


@pytest.mark.slow
def test_async_steps_bound_their_staleness_drop_a_stale_batch_and_replay(tmp_path: Path) -> None:
    port = free_port()
    engine = {"max_staleness": 1, "tis_cap": 2.0, "faults": {"stale_rollout_steps": [DRILL]}}
    config = tiny_config(tmp_path / "grpod.toml", port, engine, linger_seconds=60)
    g = Grpod(["--config", str(config), "--run-dir", "run", "--max-steps", str(STEPS)], tmp_path)
    try:
        g.wait_event(lambda e: e["event"] == "stopped", timeout=300)  # the server lingers
        metrics = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        g.signal()
        rc = g.wait()
    assert rc == 0, g.stderr[-2000:]

    stored = stored_batches(tmp_path / "run")
    assert sorted(stored) == list(range(STEPS))
    assert all(outcome == "applied" for outcome, _ in stored.values()), stored
    staleness = {step: report["staleness"] for step, (_, report) in stored.items()}
    versions = {step: report["weight_version"] for step, (_, report) in stored.items()}
    # step 0 and 1 sample from the initial weights; then each step's batch is one update
    # behind the policy that trains on it, except the drilled step's fresh one
    assert staleness == {0: 0, 1: 1, 2: 1, 3: 0, 4: 1, 5: 1}, staleness
    assert versions == {0: 0, 1: 0, 2: 1, 3: 3, 4: 3, 5: 4}, versions

    dropped = [e for e in g.events if e["event"] == "rollout dropped"]
    assert [(e["step"], e["weight_version"], e["staleness"]) for e in dropped] == [(DRILL, 1, 2)]
    assert metrics['grpod_rollout_dropped_total{reason="stale"}'] == 1
    assert metrics["grpod_rollout_staleness_steps_count"] == STEPS
    assert metrics['grpod_rollout_staleness_steps_bucket{le="0.0"}'] == 2
    assert metrics['grpod_rollout_staleness_steps_bucket{le="1.0"}'] == STEPS
    logged = {e["step"]: e.get("staleness") for e in g.steps()}
    assert logged == staleness

    for step in (DRILL + 1, STEPS - 1):  # async steps, sampled a version behind
        done = cli("replay", "--run-dir", "run", "--step", str(step), "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["reproduced"] is True and result["step"] == step, result
