"""Real, tiny `grpod run`s shared by the scrape and plot tests (2 CPU cores: each runs once).

Each daemon runs as a subprocess on an ephemeral port and lingers after its loop stops so
its final state can be scraped, then gets SIGTERM. `daemon_run` goes to max_steps with one
injected NaN-loss step (its scrape carries findings and an incident; its run directory is
what `grpod plot` renders); `halted_run` has the reversed-chunk accounting fault and halts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dashboards.helpers import ROOT

MAX_STEPS = 6
FAULT_STEP = 3
EVAL_EVERY = 2
# copy's own reward (weight 1: the rewards are the task's) and a second one shown beside it
REWARDS = ("grpod.engine.data.tasks:first_token_reward", "tests.guards.rewards:digit_first")
AUDIT = "grpod.engine.data.tasks:exact_match_reward"  # scored, never trained on


def daemon_section(max_steps: int) -> str:
    """The `[daemon]` section both runs share: metrics on an ephemeral port, JSON logs,
    lingering after the loop so the final state can be scraped."""
    return f"""
[daemon]
max_steps = {max_steps}
metrics_host = "127.0.0.1"
metrics_port = 0
linger_seconds = 120
log_format = "json"
progress = "off"
"""


TINY_CONFIG = f"""
[engine]
task = "copy"
prompts_per_step = 4
group_size = 4
threads = 1
rewards = ["{REWARDS[0]}", "{REWARDS[1]}"]
reward_weights = [1.0, 0.0]
audit_rewards = ["{AUDIT}"]
eval_task = "arith"
eval_every = {EVAL_EVERY}
eval_samples = 4

[engine.faults]
nan_loss_steps = [{FAULT_STEP}]

# `advantage` on any mostly-alike step, whatever came before and however likely: a finding of
# a campaign guard, for the panel that shows when each fired
[guards.advantage]
history_fraction_max = 1.0
tail_probability_max = 1.0

# the loop's end waits for every incident's attribution (10 s by default: on a loaded machine
# the child may need more), so the scrape has the attribution's labelled timestamp; at nice 0
# and not in the idle class, since either beside the suite's other busy processes gets ~1% of
# a core (CI: 300 s passed before it finished two 5 s attributions; beside two busy processes
# this fixture ran out of pytest's 600 s at nice 0 in the idle class)
[forensics.attribution]
shutdown_wait_seconds = 600
nice = 0
idle = false
""" + daemon_section(MAX_STEPS)
# The W2 accounting workload cut down for CPU (as guards' vtc-last-chunk drill), faulty.
HALT_CONFIG = """
[engine]
task = "kv-retrieval"
seq_len = 256
sequence_chunks = 4
lmhead_chunks = 4
prompts_per_step = 2
group_size = 4
micro_batch_rows = 2
max_new_tokens = 2
threads = 1

[engine.faults]
accounting = "last_micro_first_chunk"
""" + daemon_section(20)
START_TIMEOUT_SECONDS = 180
RUN_TIMEOUT_SECONDS = 900  # > the tiny run's attribution wait (600 s): only a hang fails


@dataclass
class DaemonRun:
    run_dir: Path
    metrics_url: str
    scrape: str  # the /metrics text after the last step
    exit_code: int  # the loop's, from the "stopped" log event
    log: str  # stdout (JSON lines) and stderr


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""  # not serving (yet, or any more)


def _read_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


@pytest.fixture(scope="session")
def daemon_run(tmp_path_factory: pytest.TempPathFactory) -> DaemonRun:
    """The tiny campaign run to max_steps (one NaN-loss step flushed), scraped at its end."""
    return run_daemon(tmp_path_factory.mktemp("grpod_dash"), TINY_CONFIG)


@pytest.fixture(scope="session")
def halted_run(tmp_path_factory: pytest.TempPathFactory) -> DaemonRun:
    """The reversed-chunk accounting fault on every step: the guards flush (or skip-fast)
    each one and HALT after `halt_after_consecutive_flushes`; scraped after the halt."""
    return run_daemon(tmp_path_factory.mktemp("grpod_dash_halt"), HALT_CONFIG)


def run_daemon(base: Path, config_text: str) -> DaemonRun:
    """Run `grpod run` until its loop stops, scrape it while it lingers, SIGTERM it."""
    config = base / "grpod.toml"
    config.write_text(config_text)
    run_dir = base / "run"
    stdout, stderr = base / "stdout.jsonl", base / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpod.daemon.cli", "run", "--config", str(config),
             "--run-dir", str(run_dir)],
            cwd=ROOT, env=env, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        metrics_url = _wait_for_event(proc, stdout, stderr, "started", START_TIMEOUT_SECONDS)[
            "metrics"
        ]
        stopped = _wait_for_event(proc, stdout, stderr, "stopped", RUN_TIMEOUT_SECONDS)
        status, scrape = _get(metrics_url)  # the loop is over; the daemon lingers
        assert status == 200, f"no scrape while lingering: HTTP {status}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return DaemonRun(
        run_dir,
        str(metrics_url),
        scrape,
        int(stopped["exit_code"]),
        stdout.read_text() + stderr.read_text(),
    )


def _wait_for_event(
    proc: subprocess.Popen, stdout: Path, stderr: Path, name: str, timeout: float
) -> dict:
    """The first JSON log event called `name`; fails if the daemon exits or times out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in _read_events(stdout):
            if event.get("event") == name:
                return event
        if proc.poll() is not None:
            pytest.fail(
                f"grpod run exited {proc.returncode} before {name!r}:\n{stderr.read_text()}"
            )
        time.sleep(0.5)
    pytest.fail(f"grpod run logged no {name!r} event in {timeout}s")
