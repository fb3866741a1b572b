"""End-to-end: real `grpod run` subprocesses on the tiny model (metrics, health, notify,
signals, resume, HALT). Each run is a few steps of 16 completions on one thread."""

from __future__ import annotations

import json
import math
import random
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.daemon.helpers import (
    GRPOD,
    TINY_ENGINE,
    Grpod,
    NotifySocket,
    free_port,
    http_get,
    parse_metrics,
    run_to_end,
    tiny_config,
    wait_until,
    write_config,
)
from tests.daemon.stepgate import ENV, SPEC, StepGate

pytestmark = pytest.mark.slow
STEPS = 8
COMPLETIONS = TINY_ENGINE["prompts_per_step"] * TINY_ENGINE["group_size"]  # a step's


def gated_config(path: Path, **daemon: object) -> Path:
    """The tiny config scored by the step gate's reward (the task's own, and a hold point)."""
    return tiny_config(path, free_port(), {"rewards": [SPEC]}, **daemon)


def max_recorded(run_dir: Path) -> int:
    """The highest committed step (-1: none yet); WAL: safe to read while the daemon runs."""
    return max((step for step, *_ in recorded_steps(run_dir)), default=-1)


def recorded_steps(run_dir: Path) -> list[tuple[int, str, int, dict]]:
    """(step, outcome, rerun, report) of every record, in recording order."""
    with sqlite3.connect(run_dir / "grpod.sqlite") as db:
        rows = db.execute(
            "SELECT step, outcome, rerun, report_json FROM steps ORDER BY id"
        ).fetchall()
    return [(step, outcome, rerun, json.loads(report)) for step, outcome, rerun, report in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """state_digest() after an uninterrupted STEPS-step run."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    config = gated_config(cwd / "grpod.toml")
    args = ["--config", str(config), "--run-dir", "run", "--max-steps", str(STEPS)]
    g = run_to_end(args, cwd, ENV)
    stopped = g.event("stopped")
    assert stopped["next_step"] == STEPS
    return stopped["state_digest"]


def test_metrics_health_notify_and_reload(tmp_path: Path) -> None:
    port = free_port()
    config = tiny_config(tmp_path / "grpod.toml", port, linger_seconds=60)
    good = config.read_text()
    notify = NotifySocket(tmp_path / "notify.sock")
    g = Grpod(  # no max_steps: the run ends at the SIGTERM, however fast it steps
        ["--config", str(config), "--run-dir", "run", "--max-steps", "0"],
        tmp_path,
        env={"NOTIFY_SOCKET": str(notify.path)},
    )
    try:
        g.wait_step(1)
        # `grpod status` reports the store's last step: wait until step 1 is committed
        wait_until(lambda: max_recorded(tmp_path / "run") >= 1, "step 1 committed", g.alive)
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        live = subprocess.run(
            [GRPOD, "status", "--run-dir", "run", "--json"], cwd=tmp_path, capture_output=True
        )
        assert live.returncode == 0, live.stderr
        state = json.loads(live.stdout)
        assert state["state"] == "running" and state["last_step"] >= 1
        # SIGHUP reloads [guards]; a bad file is refused and the old thresholds kept
        config.write_text("[guards\n")
        g.signal(signal.SIGHUP)
        failed = g.wait_event(lambda e: e["event"] == "reload failed")
        assert "not valid TOML" in failed["error"]
        config.write_text(good)
        g.signal(signal.SIGHUP)
        g.wait_event(lambda e: e["event"] == "reloaded")

        g.signal(signal.SIGTERM)
        g.wait_event(lambda e: e["event"] == "stopped")  # the loop is over; the server lingers
        status, body = http_get(f"http://127.0.0.1:{port}/healthz")
        assert status == 503 and "loop stopped" in body
        metrics = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        g.signal(signal.SIGTERM)  # a stop signal ends the linger
        rc = g.wait()
        notify.close()
    assert rc == 0, g.stderr

    records = recorded_steps(tmp_path / "run")
    step, _, _, report = records[-1]
    assert step == g.event("stopped")["next_step"] - 1 and metrics["grpod_step"] == step
    for gauge, key in {
        "grpod_loss": "loss",
        "grpod_reward_mean": "reward_mean",
        "grpod_valid_tokens": "valid_tokens",
        "grpod_expected_valid_tokens": "expected_valid_tokens",
        "grpod_grad_norm": "grad_norm",
        "grpod_clip_coefficient": "clip_coef",
        "grpod_learning_rate": "lr",
        "grpod_zero_std_group_fraction": "zero_std_group_fraction",
        'grpod_clip_fraction{side="high"}': "clip_fraction_high",
        "grpod_sampler_mismatch_p90_nats": "mismatch_p90",
        "grpod_sampler_mismatch_fraction": "mismatch_frac_above_0_1",
    }.items():
        recorded = float(report[key]) if report[key] is not None else math.nan
        assert metrics[gauge] == recorded or (math.isnan(recorded) and math.isnan(metrics[gauge]))
    outcomes = [o for _, o, _, _ in records]
    for name in ("applied", "flushed", "skipped"):
        assert metrics[f'grpod_steps_total{{outcome="{name}"}}'] == outcomes.count(name)
    assert metrics["grpod_recorder_queue_depth"] == 0
    assert metrics["grpod_recorder_uncommitted_steps"] == 0  # the stop committed everything
    assert metrics["grpod_halted"] == 0
    assert 'grpod_phase_duration_seconds_count{phase="checkpoint"}' in metrics
    assert any(key.startswith("grpod_build_info{") for key in metrics)

    assert notify.fields("READY") == ["1"]
    assert "1" in notify.fields("WATCHDOG")
    assert notify.fields("EXTEND_TIMEOUT_USEC")
    assert notify.fields("STOPPING") == ["1"]
    statuses = notify.fields("STATUS")
    assert "READY=1\nSTATUS=ready; next step 0" in notify.messages
    assert any(s.startswith("step ") and "last verdict" in s for s in statuses)
    assert statuses[-1] == "stopped: stopped by SIGTERM"


def test_sigterm_then_resume_is_bit_identical(tmp_path: Path, uninterrupted: str) -> None:
    config = gated_config(tmp_path / "grpod.toml")
    args = ["--config", str(config), "--run-dir", "run", "--max-steps", str(STEPS)]
    at = random.randint(1, STEPS - 3)
    gate = StepGate(tmp_path / "gate", at + 1, COMPLETIONS)  # held in step at + 1's compute
    g = Grpod(args, tmp_path, gate.env)
    gate.wait_held(g.alive)
    g.signal(signal.SIGTERM)  # handled, the gate lets the step in flight finish
    assert g.wait() == 0, g.stderr
    stopped = g.event("stopped")
    assert stopped["reason"] == "stopped by SIGTERM"
    stopped_at = stopped["next_step"]
    assert at < stopped_at < STEPS, f"SIGTERM after step {at} stopped at {stopped_at}"
    assert (tmp_path / "run" / "checkpoints" / f"step-{stopped_at:08d}" / "state.json").is_file()

    status = subprocess.run(
        [GRPOD, "status", "--run-dir", "run", "--json"], cwd=tmp_path, capture_output=True
    )
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["state"] == "stopped" and state["last_step"] == stopped_at - 1

    resumed = run_to_end(args, tmp_path, ENV)
    assert resumed.event("started")["resumed_from"] == stopped_at
    assert resumed.event("stopped")["state_digest"] == uninterrupted
    records = recorded_steps(tmp_path / "run")
    assert [s for s, *_ in records] == list(range(STEPS))
    assert not any(rerun for _, _, rerun, _ in records)


def test_sigkill_then_resume_reruns_and_fsck_passes(tmp_path: Path, uninterrupted: str) -> None:
    # checkpoints every 4 steps: steps 0-1 are recorded after the initial checkpoint only
    config = gated_config(tmp_path / "grpod.toml", checkpoint_every=4)
    args = ["--config", str(config), "--run-dir", "run", "--max-steps", str(STEPS)]
    gate = StepGate(tmp_path / "gate", 2, COMPLETIONS)  # held in step 2: killed, never ends
    g = Grpod(args, tmp_path, gate.env)
    gate.wait_held(g.alive)
    # steps 0 and 1 committed by the writer's interval while step 2 is held
    wait_until(lambda: max_recorded(tmp_path / "run") >= 1, "steps 0-1 committed", g.alive)
    g.signal(signal.SIGKILL)
    assert g.wait() == -signal.SIGKILL

    resumed = run_to_end(args, tmp_path, ENV)
    started = resumed.event("started")
    assert started["resumed_from"] in (0, 4)
    assert resumed.event("stopped")["state_digest"] == uninterrupted
    records = recorded_steps(tmp_path / "run")
    assert sorted({s for s, *_ in records}) == list(range(STEPS))
    seen: set[int] = set()
    for step, _, rerun, _ in records:
        assert bool(rerun) == (step in seen), f"step {step}: rerun flag {rerun}"
        seen.add(step)
    reran = started["rerun_through"] >= started["resumed_from"]  # recorded after the checkpoint
    assert any(rerun for _, _, rerun, _ in records) == reran
    assert reran or started["resumed_from"] == 4  # killed after step 1 was committed
    fsck = subprocess.run(
        [GRPOD, "fsck", "--run-dir", "run"], cwd=tmp_path, capture_output=True, text=True
    )
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_halt_checkpoints_and_exits_3(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**HALT_ENGINE},
            "guards": {"halt_after_consecutive_flushes": 2},
            "daemon": {
                "metrics_port": (port := free_port()),
                "linger_seconds": 60,
                "log_format": "json",
                "progress": "off",
            },
        },
    )
    notify = NotifySocket(tmp_path / "notify.sock")
    g = Grpod(
        ["--config", str(config), "--run-dir", "run", "--max-steps", "8"],
        tmp_path,
        env={"NOTIFY_SOCKET": str(notify.path)},
    )
    try:
        g.wait_event(lambda e: e["event"] == "stopped")
        metrics = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics")[1])
        assert metrics["grpod_halted"] == 1 and metrics["grpod_verdict_action"] == 3
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 503
    finally:
        g.signal(signal.SIGTERM)  # ends the linger; the exit code stays 3
        rc = g.wait()
        notify.close()
    assert rc == 3, g.stderr
    stopping = g.event("stopping")
    assert stopping["level"] == "error" and "HALT" in stopping["reason"]
    halted_at = g.event("stopped")["next_step"]
    assert (tmp_path / "run" / "checkpoints" / f"step-{halted_at:08d}").is_dir()
    assert any(s.startswith("halted: HALT") for s in notify.fields("STATUS"))
    assert recorded_steps(tmp_path / "run")[-1][1] == "flushed"


HALT_ENGINE = {**TINY_ENGINE, "faults": {"nan_loss_steps": [1, 2]}}


def test_second_sigterm_drops_the_step_and_exits_without_checkpoint(tmp_path: Path) -> None:
    config = gated_config(tmp_path / "grpod.toml", checkpoint_every=100)
    gate = StepGate(tmp_path / "gate", 2, COMPLETIONS, release=2)  # held in step 2's compute
    args = ["--config", str(config), "--run-dir", "run", "--max-steps", "50"]
    g = Grpod(args, tmp_path, gate.env)
    gate.wait_held(g.alive)
    g.signal(signal.SIGTERM)
    gate.wait_handled(1, g.alive)  # sent before the first was handled, the two would merge
    g.signal(signal.SIGTERM)  # still in step 2's compute: the step is dropped
    assert g.wait() == 128 + signal.SIGTERM, g.stderr
    stopped = g.event("stopped")
    assert stopped["reason"].startswith("second SIGTERM: the step in flight was dropped")
    events = [e["event"] for e in g.events]
    assert "checkpoint" not in events[events.index("stopping") :]
    assert max(s for s, *_ in recorded_steps(tmp_path / "run")) < stopped["next_step"] == 2

    args = ["--config", str(config), "--run-dir", "run", "--max-steps", "2"]
    resumed = run_to_end(args, tmp_path, ENV)
    assert resumed.event("started")["resumed_from"] == 0
    fresh = run_to_end([*args[:2], "--run-dir", "fresh", *args[4:]], tmp_path, ENV)
    assert resumed.event("stopped")["state_digest"] == fresh.event("stopped")["state_digest"]
