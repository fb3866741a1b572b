"""One real, tiny `grpod run` shared by the scrape and plot tests (2 CPU cores: run it once).

The daemon runs as a subprocess on an ephemeral port with one injected NaN-loss step, so
its scrape carries findings and an incident; it lingers after its last step so the final
state can be scraped, then gets SIGTERM. Its run directory is what `grpod plot` renders.
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
TINY_CONFIG = f"""
[engine]
task = "copy"
prompts_per_step = 4
group_size = 4
threads = 1
fault_nan_loss_steps = [{FAULT_STEP}]

[daemon]
max_steps = {MAX_STEPS}
metrics_host = "127.0.0.1"
metrics_port = 0
linger_seconds = 120
log_format = "json"
progress = "off"
"""
START_TIMEOUT_SECONDS = 180
RUN_TIMEOUT_SECONDS = 300


@dataclass
class DaemonRun:
    run_dir: Path
    metrics_url: str
    scrape: str  # the /metrics text after the last step
    exit_code: int
    log: str  # stdout (JSON lines) and stderr


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""  # not serving (yet, or any more)


def _steps_total(scrape: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scrape.splitlines()
        if line.startswith("grpod_steps_total{")
    )


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
    """Run the tiny campaign to its end, scrape it while it lingers, stop it."""
    base = tmp_path_factory.mktemp("grpod_dash")
    config = base / "grpod.toml"
    config.write_text(TINY_CONFIG)
    run_dir = base / "run"
    stdout, stderr = base / "stdout.jsonl", base / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "run", "--config", str(config),
             "--run-dir", str(run_dir)],
            cwd=ROOT, env=env, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        metrics_url = _wait_for_metrics_url(proc, stdout, stderr)
        scrape = _wait_for_last_step(proc, metrics_url, stderr)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    return DaemonRun(
        run_dir, metrics_url, scrape, exit_code, stdout.read_text() + stderr.read_text()
    )


def _wait_for_metrics_url(proc: subprocess.Popen, stdout: Path, stderr: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        for event in _read_events(stdout):
            if event.get("event") == "started" and event.get("metrics"):
                return str(event["metrics"])
        if proc.poll() is not None:
            pytest.fail(f"grpod run exited {proc.returncode} before serving:\n{stderr.read_text()}")
        time.sleep(0.5)
    pytest.fail(f"grpod run logged no metrics URL in {START_TIMEOUT_SECONDS}s")


def _wait_for_last_step(proc: subprocess.Popen, metrics_url: str, stderr: Path) -> str:
    """Scrape until every step is counted and the flight recorder has caught up."""
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    health_url = metrics_url.rsplit("/", 1)[0] + "/healthz"
    while time.monotonic() < deadline:
        status, scrape = _get(metrics_url)
        if status == 200 and _steps_total(scrape) >= MAX_STEPS:
            health, _ = _get(health_url)
            if health == 503:  # the loop has stopped; the daemon lingers for this scrape
                return _get(metrics_url)[1]
        if proc.poll() is not None:
            pytest.fail(f"grpod run exited {proc.returncode} while running:\n{stderr.read_text()}")
        time.sleep(0.5)
    pytest.fail(f"grpod run did not finish {MAX_STEPS} steps in {RUN_TIMEOUT_SECONDS}s")
