"""A soak in CI: a real `grpod run` of a setting that collapses fast (lr 0.03 on `copy`: the
policy turns deterministic within ~10 steps, every group's rewards equal from then on).

It asserts what the 10,000-step soak of issue 19 showed was missing: a handful of episodes
instead of one incident per WARN step, the dead-campaign HALT (exit 3, checkpointed) with its
one reason, and RSS and the series count flat while it runs: sampled at every step from
step 20 on as the step's log line is read, the daemon never more than a page of log ahead
(it blocks on the pipe), so the samples follow the run's steps, not the machine's speed.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import GRPOD, TINY_ENGINE, Grpod, http_get, write_config

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

DEAD_STEPS = 100  # the dead_campaign window (default 200): HALT at step ~110
FIRST_SAMPLED_STEP = 20


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def test_a_collapsing_campaign_halts_once_with_few_episodes(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {**TINY_ENGINE, "lr": 0.03},
            "guards.dead_campaign": {"steps": DEAD_STEPS},
            "daemon": {
                "max_steps": 400,
                "metrics_port": 0,
                "log_format": "json",
                "progress": "off",
                "linger_seconds": 3600,  # only a SIGTERM ends it within the test
            },
        },
    )
    run_dir = tmp_path / "run"
    started: dict[str, Any] = {}
    samples: list[tuple[int, float, int]] = []  # (step, RSS MiB, series) from step 20 on

    def sample(event: dict[str, Any]) -> None:  # on the reader thread, as each line is read
        if event["event"] == "started":
            started.update(event)
        elif event["event"] == "step" and event["step"] >= FIRST_SAMPLED_STEP:
            status, text = http_get(started["metrics"])
            assert status == 200, (event["step"], status)
            samples.append((event["step"], _rss_mib(started["pid"]), _series(text)))

    args = ["--config", str(config), "--run-dir", str(run_dir)]
    grpod = Grpod(args, tmp_path, on_event=sample, pipe_bytes=4096)
    grpod.wait_event(lambda e: e["event"] == "stopping", timeout=300)
    final = http_get(started["metrics"])[1]  # stopping (checkpoint, linger): the last state
    grpod.signal(signal.SIGTERM)  # during the halt checkpoint or the linger: either ends it
    try:
        code = grpod.wait()  # its timeout only bounds a failure: the linger is an hour
    except subprocess.TimeoutExpired:
        grpod.proc.kill()
        raise AssertionError("the SIGTERM did not end the linger") from None
    assert code == 3, grpod.stderr[-2000:]

    stopping = grpod.event("stopping")
    halt_step = grpod.steps()[-1]["step"]
    assert DEAD_STEPS - 1 <= halt_step < 2 * DEAD_STEPS, halt_step  # steps 0..99: 100
    assert "dead_campaign" in stopping["reason"], stopping
    assert f"no learning signal for {DEAD_STEPS} steps" in stopping["reason"]
    assert grpod.event("checkpoint")["reason"] == "halt"
    assert "grpod_halted 1.0" in final.splitlines()

    listing = subprocess.run(
        [GRPOD, "incidents", "list", "--json", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    episodes = json.loads(listing.stdout)
    warned = sum(1 for e in grpod.steps() if e["verdict"] != "PASS")
    # the collapse is gradual: no sudden loss for `advantage`; `entropy` WARNs once its rolling
    # mean is under the floor (step ~55), on every step until the HALT...
    assert warned >= 0.3 * DEAD_STEPS, warned
    assert len(episodes) <= 8, [(e["guard"], e["kind"], e["step"]) for e in episodes]
    (dead,) = [e for e in episodes if e["guard"] == "dead_campaign"]  # ...in a few episodes
    assert (dead["action"], dead["step"], dead["steps"]) == ("HALT", halt_step, 1)
    warnings = [e for e in episodes if e["guard"] != "dead_campaign"]
    longest = max(warnings, key=lambda e: e["steps"])  # one episode, not one incident a step
    assert longest["steps"] >= 0.9 * warned and longest["step"] + longest["span_steps"] > halt_step
    assert all(e["status"] == "closed" for e in episodes)  # the run stopped

    assert len(samples) >= 10, samples
    rss = [r for _, r, _ in samples]
    assert max(rss) - rss[0] < 40, samples  # MiB: flat, not growing per step or incident
    # bounded: a guard's first finding adds its label pair to grpod_findings_total (a counter:
    # its `_total` and `_created` samples), nothing per step or per incident
    series = [s for _, _, s in samples]
    assert series == sorted(series) and series[-1] - series[0] <= 2 * len(episodes), samples
