"""Incidents carry their attribution (forensics/incident_attribution.py): the queue, its
bounds (samples, pending, seconds, memory), the notes stored instead, the stop, the
recorder's hook and the real child process on a recorded incident."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from grpod.daemon.metrics import Metrics
from grpod.forensics import FlightRecorder, ForensicsConfig, show_incident
from grpod.forensics import pace as pace_module
from grpod.forensics.config import GPU_RUN_FRACTION, AttributionConfig
from grpod.forensics.incident_attribution import (
    STOPPED,
    AttributionRecord,
    IncidentAttributor,
    child_command,
)
from grpod.forensics.pace import CHECK_SECONDS, FreePipe, Pace
from tests.daemon.helpers import wait_until
from tests.forensics.campaign import Campaign
from tests.forensics.conftest import FAULT_STEP
from tests.forensics.test_store import decided, tiny_batch, tiny_report

ATTRIBUTION = {  # what the child prints: StepAttribution.to_dict(), cut to what is read here
    "step": FAULT_STEP,
    "samples": [{"index": 3, "prompt_id": 29, "share": None}, {"index": 0, "prompt_id": 28}],
    "nonfinite": {"sample": 3, "token": 1, "module": "model.layers.1.mlp.down_proj"},
    "seconds": 0.5,
    "note": "",
}


@pytest.fixture
def run(recorded: Campaign, tmp_path: Path) -> Path:
    """A copy of the recorded campaign: incident 1 at FAULT_STEP."""
    copy = tmp_path / "run"
    shutil.copytree(recorded.run_dir, copy)
    return copy


def python(code: str) -> Any:
    """A child command that runs `code` (for every incident)."""
    return lambda incident: [sys.executable, "-c", code]


def never(incident: int) -> list[str]:
    raise AssertionError("no child may start")


def stored(run: Path, incident: int = 1) -> dict[str, Any]:
    return show_incident(run, incident)


def attributor(run: Path, command: Any, **config: Any) -> IncidentAttributor:
    return IncidentAttributor(run, AttributionConfig(**config), command=command)


def test_a_done_attribution_is_stored_with_its_incident(run: Path) -> None:
    records: list[AttributionRecord] = []
    worker = IncidentAttributor(
        run,
        command=python(f"print({json.dumps(json.dumps(ATTRIBUTION))})"),
        on_done=records.append,
    )
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(60)
    worker.close()
    shown = stored(run)
    assert [s["index"] for s in shown["samples"]] == [3, 0]
    assert shown["nonfinite"]["module"] == "model.layers.1.mlp.down_proj"
    info = shown["attribution"]
    assert info["status"] == "done" and info["step"] == FAULT_STEP and info["seconds"] == 0.5
    assert info["process_seconds"] > 0
    assert [r.status for r in records] == ["done"] and records[0].top["index"] == 3
    assert worker.totals["done"] == 1


def test_an_incident_without_a_row_says_how_to_compute_it(run: Path) -> None:
    shown = stored(run)
    assert shown["samples"] == [] and shown["nonfinite"] is None
    assert shown["attribution"]["status"] == "none"
    assert "grpod incidents show 1 --by-sample" in shown["attribution"]["note"]


def test_a_step_over_max_samples_is_skipped_with_a_note(run: Path) -> None:
    worker = attributor(run, never, max_samples=8)
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)
    worker.close()
    info = stored(run)["attribution"]
    assert info["status"] == "skipped"
    assert "16 samples, over [forensics.attribution] max_samples = 8" in info["note"]


def test_attribution_off_stores_a_note_and_starts_nothing(run: Path) -> None:
    worker = attributor(run, never, enabled=False)
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)
    worker.close()
    assert "enabled = false" in stored(run)["attribution"]["note"]


def test_a_child_past_max_seconds_is_stopped(run: Path) -> None:
    worker = attributor(run, python("import time; time.sleep(60)"), max_seconds=0.5)
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)  # idle before the child's 60 s were up: it was stopped
    worker.close()
    info = stored(run)["attribution"]
    assert info["status"] == "failed" and "max_seconds = 0.5" in info["note"]


def test_a_child_past_max_rss_is_stopped(run: Path) -> None:
    grow = "import time; x = bytearray(256 * 2**20); x[::4096] = b'1' * len(x[::4096]); "
    worker = attributor(run, python(grow + "time.sleep(60)"), max_rss_mib=64)
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)
    worker.close()
    info = stored(run)["attribution"]
    assert info["status"] == "failed" and "max_rss_mib = 64" in info["note"]


def test_a_failed_child_leaves_its_last_line(run: Path) -> None:
    code = "import sys; print('incident 1: no checkpoint', file=sys.stderr); sys.exit(2)"
    worker = attributor(run, python(code))
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)
    worker.close()
    info = stored(run)["attribution"]
    assert info["status"] == "failed"
    assert info["note"] == "attribution failed: incident 1: no checkpoint"


def test_a_child_that_cannot_start_is_a_failed_note(run: Path) -> None:
    worker = attributor(run, lambda incident: [str(run / "no-such-program")])
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(30)
    worker.close()
    info = stored(run)["attribution"]
    assert info["status"] == "failed" and "FileNotFoundError" in info["note"]
    assert worker.error is None


def test_over_max_pending_is_skipped_and_a_stop_is_bounded(run: Path) -> None:
    """One runs (a child that would take a minute), one waits, the third is one too many;
    the stop kills the child after its wait and notes both as not computed."""
    records: list[AttributionRecord] = []
    started = run / "child-started"
    worker = IncidentAttributor(
        run,
        AttributionConfig(max_pending=2),
        command=python(
            f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(60)"
        ),
        on_done=records.append,
    )
    for _ in range(3):
        worker.submit(1, FAULT_STEP, 16)
    wait_until(started.exists, "the first child started")
    worker.close(0.5)  # returns with the child killed (its record "stopped", below)
    assert worker.pending == 0
    assert [(r.status, r.note) for r in records[:2]] == [("stopped", STOPPED)] * 2
    assert records[2].status == "skipped"
    assert "2 incidents were waiting" in records[2].note and "max_pending = 2" in records[2].note
    assert records[0].seconds is not None  # its child ran, and was killed


def test_a_submit_after_close_is_not_run(run: Path) -> None:
    worker = attributor(run, never)
    worker.close(0.0)
    worker.submit(1, FAULT_STEP, 16)  # the recorder's last commit, after the stop
    assert worker.pending == 1  # nothing runs it: the incident keeps "no attribution"
    assert stored(run)["attribution"]["status"] == "none"


def test_the_recorder_hands_over_each_new_incident(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int]] = []
    recorder = FlightRecorder(tmp_path, ForensicsConfig(), on_incident=lambda *a: seen.append(a))
    recorder.start_run("r", {}, {}, "cpu")
    finding = {"guard": "finite", "action": "FLUSH", "message": "loss is nan"}
    flush = {"action": "FLUSH", "findings": [finding]}
    ok = {"action": "PASS", "findings": []}
    for step, verdict in enumerate([ok, flush, flush, ok]):
        recorder.record(decided(tiny_batch(step), tiny_report(step), verdict, "flushed"))
    recorder.close()
    assert seen == [(1, 1, 2)]  # one episode (steps 1-2), its first step, its 2 samples


def test_the_metrics_label_the_last_attribution() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.observe_attribution(AttributionRecord(1, 7, "done", "", 2.0, ATTRIBUTION), now=5.0)
    metrics.observe_attribution(AttributionRecord(2, 9, "skipped", "too large"))
    metrics.observe_attribution(
        AttributionRecord(3, 11, "done", "", 2.0, {**ATTRIBUTION, "nonfinite": None}), now=6.0
    )
    labels = {"incident": "3", "step": "11", "sample": "3", "module": ""}
    name = "grpod_incident_attribution_timestamp_seconds"
    assert registry.get_sample_value(name, labels) == 6.0
    old = {"incident": "1", "step": "7", "sample": "3", "module": "model.layers.1.mlp.down_proj"}
    assert registry.get_sample_value(name, old) is None  # one series: the last
    total = "grpod_incident_attributions_total"
    assert registry.get_sample_value(total, {"status": "done"}) == 2
    assert registry.get_sample_value(total, {"status": "skipped"}) == 1
    assert registry.get_sample_value(total, {"status": "stopped"}) == 0


def test_the_real_child_attributes_a_recorded_incident(run: Path) -> None:
    """The child process the daemon starts: niced, one thread, JSON back, stored."""
    command = child_command(run, 1, AttributionConfig())
    assert command[1:3] == ["-m", "grpod.forensics.incident_attribution"]
    assert "--device" not in command  # the run's device
    assert command[command.index("--nice") + 1] == "19"  # below the trainer by default
    assert "--idle" in command  # and the idle class, below every niceness
    assert "--idle" not in child_command(run, 1, AttributionConfig(idle=False))
    assert child_command(run, 1, AttributionConfig(device="cpu"))[-2:] == ["--device", "cpu"]
    # the CPU's pace: unpaced (pacing: the Clocks tests); nice 0 and not idle: either lets the
    # suite's other busy processes starve it (beside two busy processes, this test ran out of
    # 300 s that it needs 5 s for, nice 0 and idle)
    worker = IncidentAttributor(run, AttributionConfig(nice=0, idle=False))
    worker.submit(1, FAULT_STEP, 16)
    assert worker.wait_idle(300)
    worker.close()
    shown = stored(run)
    assert shown["attribution"]["status"] == "done", shown["attribution"]["note"]
    assert shown["nonfinite"]["module"].startswith("the loss")  # nan_loss: after every module
    assert shown["samples"][0]["index"] == shown["nonfinite"]["sample"]
    assert {"index", "prompt_id", "share"} <= set(shown["samples"][0])
    assert shown["attribution"]["paced_seconds"] == 0
    assert shown["attribution"]["idle_class"] is False  # as configured


def test_the_child_lowers_itself_to_the_idle_class_only_when_asked() -> None:
    """`--idle` (the default config's) puts the child in SCHED_IDLE; without it, nice alone.
    Real processes: this one's class is not touched (an idle test runner would starve)."""
    code = (
        "import sys; from grpod.forensics.incident_attribution import idle_class, "
        "lower_priority; lower_priority(0, sys.argv[1] == 'idle'); print(idle_class())"
    )
    shown = {
        mode: subprocess.run(
            [sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120
        ).stdout.strip()
        for mode in ("idle", "nice")
    }
    assert shown == {"idle": "True", "nice": "False"}, shown


def burn(seconds: float, pace: Pace | None = None) -> None:
    """Spend `seconds` of this process's CPU time, pacing along the way."""
    until = time.process_time() + seconds
    while time.process_time() < until:
        sum(range(1000))
        if pace is not None:
            pace.pace()


class Clocks:
    """`pace.time` for a test: the wall and CPU clocks are set by hand; `sleep` moves the wall."""

    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.wall += seconds


def test_the_pace_sleeps_until_its_cpu_is_its_share_of_the_wall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = Clocks()
    monkeypatch.setattr(pace_module, "time", clocks)
    pace = Pace(0.25, started=100.0)
    clocks.cpu, clocks.wall = 1.0, 101.0  # 1 CPU second in 1 wall second: 3 s ahead
    pace.pace()
    assert clocks.sleeps == [3.0] and pace.slept_seconds == 3.0
    assert clocks.cpu <= 0.25 * (clocks.wall - 100.0)
    clocks.cpu += 0.001  # within the next check's 20 ms: not read again
    pace.pace()
    assert clocks.sleeps == [3.0]
    clocks.wall += CHECK_SECONDS
    clocks.cpu = 1.5  # 0.5 CPU seconds more: 2 s of wall owed
    pace.pace()
    assert clocks.sleeps[1:] == [pytest.approx(2.0 - CHECK_SECONDS)]
    assert Pace(1.0, started=0.0).free  # unpaced: never reads a clock


def test_the_pace_is_unpaced_on_the_cpu_and_bounded_on_a_gpu() -> None:
    """Auto (0): SCHED_IDLE yields a CPU's cores, nothing yields a GPU's time."""
    assert AttributionConfig().pace("cpu") == 1.0
    assert AttributionConfig().pace("cuda") == GPU_RUN_FRACTION < 1
    assert AttributionConfig(device="cpu").pace("cuda") == 1.0  # run off the trainer's GPU
    assert AttributionConfig(run_fraction=0.5).pace("cpu") == 0.5
    command = child_command(Path("run"), 1, AttributionConfig(), run_device="cuda")
    assert command[command.index("--run-fraction") + 1] == str(GPU_RUN_FRACTION)


def test_a_freed_pace_no_longer_sleeps() -> None:
    pipe = FreePipe()
    pace = Pace(0.001, time.monotonic(), pipe.read_fd)
    burn(0.05)
    pipe.free()  # EOF: the first sleep returns at once, and no later pace sleeps
    pace.pace()
    assert pace.free
    pipe.close()
    pace.pace()


CHILD_PACED = (
    "import json, time; from grpod.forensics.pace import Pace; "
    "pace = Pace.from_env(0.001, time.monotonic()); "
    "until = time.process_time() + 0.1\n"
    "while time.process_time() < until: sum(range(1000))\n"
    "pace.pace(); print(json.dumps({'note': 'freed' if pace.free else 'slept'}))"
)


def test_the_stop_frees_a_paced_child(run: Path) -> None:
    """A child paced to 0.1% of a core (100 s of sleep ahead of it) finishes in the daemon's
    shutdown wait: the stop closes its pipe and it runs unpaced."""
    worker = attributor(run, python(CHILD_PACED))
    worker.submit(1, FAULT_STEP, 16)
    time.sleep(1.0)  # it may still be starting: the pipe is held from its start either way
    worker.close(wait_seconds=60)
    info = stored(run)["attribution"]
    assert info["status"] == "done", info["note"]
    assert info["note"] == "freed"
