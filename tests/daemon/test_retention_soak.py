"""Bounded disk, automatically: a few hundred steps of a real `grpod run` on a HF model directory
with a tiny `retention_bytes` stay within it (sampled at every log line: each step, and each
checkpoint before its prune; the daemon is never more than a page of log ahead of the
sampler), old checkpoints and batches go, incident pins stay and replay, and unchanged
checkpoint files are hard links."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import Grpod, cli, free_port, http_get, parse_metrics, write_config
from tests.daemon.ownmodel import ENGINE, user_campaign
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow
STEPS, EVERY, KEEP = 240, 5, 3
# binds before KEEP does: two pinned checkpoints, the newest, the store (~1.2 MB each, 0.6 MB)
BUDGET = 5 * 1024**2 + 512 * 1024
FLUSHED = list(range(40, 45))  # one whole interval flushed: checkpoint 45 equals checkpoint 40


def disk_bytes(root: Path) -> int:
    """What the run dir holds on disk: every file once (hard links share an inode)."""
    seen: dict[tuple[int, int], int] = {}
    for base, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(base, name))
            except FileNotFoundError:  # pruned while we walked
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def test_a_soak_stays_within_retention_bytes_and_incidents_replay(tmp_path: Path) -> None:
    model = build_hf_dir(tmp_path / "model")
    user_campaign(tmp_path, model)
    port = free_port()
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**ENGINE, "model": str(model)},
            "engine.faults": {"nan_loss_steps": [*FLUSHED, 150]},
            "guards": {"halt_after_consecutive_flushes": 0},
            "guards.dead_campaign": {"action": "WARN"},  # this campaign collapses by ~200
            "forensics": {
                "keep_checkpoints": KEEP,
                "retention_bytes": BUDGET,
                "incident_action": "FLUSH",
            },
            "daemon": {
                "metrics_port": port,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": EVERY,
                "max_steps": STEPS,
                "linger_seconds": 30,
            },
        },
    )
    run_dir = tmp_path / "run"
    peak = [0]

    def sample(event: dict[str, Any]) -> None:  # on the reader thread, as each line is read
        peak[0] = max(peak[0], disk_bytes(run_dir))

    args = ["--config", str(config), "--run-dir", str(run_dir)]
    run = Grpod(args, tmp_path, on_event=sample, pipe_bytes=4096)
    try:
        run.wait_event(lambda e: e["event"] == "stopped", timeout=600)
        _, text = http_get(f"http://127.0.0.1:{port}/metrics")
        metrics = parse_metrics(text)
        run.signal()  # end the linger
        assert run.wait() == 0, run.stderr[-2000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert peak[0] <= BUDGET, f"run dir peaked at {peak[0]} bytes, budget {BUDGET}"

    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-00000040", "step-00000150", f"step-{STEPS:08d}"]  # pins, newest
    pruned = [e for e in run.events if e["event"] == "pruned"]
    assert sum(len(e["checkpoints"]) for e in pruned) == STEPS // EVERY + 1 - len(checkpoints)
    assert metrics['grpod_pruned_total{kind="checkpoint"}'] == sum(
        len(e["checkpoints"]) for e in pruned
    )
    assert metrics["grpod_pruned_bytes_total"] == sum(e["freed_bytes"] for e in pruned) > 0
    assert 0 < metrics["grpod_retained_bytes"] <= BUDGET
    linked = {
        e["path"].rsplit("/", 1)[-1]: e["linked"] for e in run.events if e["event"] == "checkpoint"
    }
    weights = (run_dir / "checkpoints/step-00000040/model.safetensors").stat().st_size
    assert linked["step-00000045"] >= weights  # nothing moved: weights and AdamW linked
    assert all(v == 0 for k, v in linked.items() if k not in ("step-00000045",))

    def grpod(*args: str):
        return cli(*args, "--run-dir", str(run_dir), cwd=tmp_path)

    assert grpod("fsck").returncode == 0
    incidents = json.loads(grpod("incidents", "list", "--json").stdout)
    # one incident per episode: the five flushed steps 40-44 are one, pinning their first step
    spans = [(row["step"], row["last_step"], row["steps"]) for row in incidents]
    assert spans == [(FLUSHED[0], FLUSHED[-1], len(FLUSHED)), (150, 150, 1)]
    replayed = grpod("replay", str(incidents[0]["id"]), "--json")  # step 40, at 40's pin
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["reproduced"] is True
