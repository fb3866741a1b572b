"""The StepSink in process (daemon/sink.py): a decided step, built by hand, is recorded by the
flight recorder, published on the registry and shown in the status view; `grpod run`'s loop
and the TRL trainer publish through the same class."""

from __future__ import annotations

import io
import json
import math
import threading
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from grpod.daemon import logs
from grpod.daemon.config import DaemonConfig, GrpodConfig
from grpod.daemon.console import StepConsole
from grpod.daemon.exitcodes import EXIT_FAILURE, EXIT_OK
from grpod.daemon.health import Health
from grpod.daemon.loop import Daemon
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.progress import Progress
from grpod.daemon.rundir import Plan, RunDir
from grpod.daemon.sink import NoRecorder, StepSink
from grpod.daemon.status_view import StatusView
from grpod.engine import EngineConfig, Outcome, StepResult
from grpod.forensics import FlightRecorder, ForensicsConfig, Store
from grpod.guards import Action, Finding, GuardsConfig, Verdict
from grpod.integrations.trl_sink import RunSink
from tests.daemon.helpers import parse_metrics
from tests.forensics.test_store import tiny_batch, tiny_report

WARN = Verdict(Action.WARN, [Finding("accounting", Action.WARN, "vtc != mask", {})])


def decided(step: int, verdict: Verdict = WARN) -> StepResult:
    phases = {"rollout": 0.04, "grad": 0.06, "optim": 0.01, "guards": 0.001}
    return StepResult(tiny_batch(step), tiny_report(step), verdict, Outcome.APPLIED, phases)


def recorded_row(run_dir: Path, step: int) -> dict[str, Any]:
    store = Store(run_dir, create=False)
    try:
        with store.session() as session:
            row = store.latest_step(session, step)
            return {k: getattr(row, k) for k in ("outcome", "rerun", "verdict_action", "loss")}
    finally:
        store.close()


def test_a_decided_step_is_recorded_scraped_and_shown(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, ForensicsConfig())
    recorder.start_run("r1", {"engine": {}}, {}, "cpu")
    registry = CollectorRegistry()
    status = StatusView(RunDir(tmp_path), "r1", next_step=lambda: 4)
    announced: list[tuple[int, bool]] = []
    sink = StepSink(
        recorder,
        metrics=Metrics(registry, {"grpod": "0", "torch": "2", "transformers": "5"}),
        rank_metrics=RankMetrics(registry, 0),
        status=status,
        health=Health(60.0),
        announce=lambda result, rerun, at: announced.append((result.step, rerun)),
        rerun_through=2,
    )
    published = sink.publish(decided(3), 0.83)
    assert published.phase_seconds["record"] >= 0.0 and announced == [(3, False)]
    recorder.close()
    sink.observe_recorder(0)  # as the daemon's shutdown: the drained queue
    assert recorded_row(tmp_path, 3) == {
        "outcome": "applied",
        "rerun": False,
        "verdict_action": "WARN",
        "loss": 0.25,
    }
    values = parse_metrics(generate_latest(registry).decode())
    assert values["grpod_step"] == 3 and values['grpod_rank_step{rank="0"}'] == 3
    assert values["grpod_loss"] == 0.25 and values["grpod_clip_coefficient"] == 0.66
    assert values['grpod_steps_total{outcome="applied"}'] == 1
    assert values['grpod_findings_total{action="WARN",guard="accounting"}'] == 1
    assert values["grpod_verdict_action"] == 1 and values["grpod_gradnorm_vtc_correlation"] == 0.83
    assert values['grpod_phase_duration_seconds_count{phase="record"}'] == 1
    assert values["grpod_recorder_queue_depth"] == 0
    view = RunDir(tmp_path).read_status()
    assert view is not None
    assert {k: view[k] for k in ("run_id", "state", "step", "next_step", "checkpoint_step")} == {
        "run_id": "r1",
        "state": "running",
        "step": 3,
        "next_step": 4,
        "checkpoint_step": -1,
    }
    assert view["last_verdict"] == "WARN (accounting: vtc != mask)"
    assert status.line() == "step 3 done, last verdict WARN (accounting: vtc != mask); next 4"


def test_a_step_the_store_held_is_recorded_as_a_rerun(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, ForensicsConfig())
    recorder.start_run("r1", {"engine": {}}, {}, "cpu")
    announced: list[tuple[int, bool]] = []
    sink = StepSink(recorder, announce=lambda r, rerun, at: announced.append((r.step, rerun)))
    sink.rerun_through = 5
    sink.publish(decided(5, Verdict(Action.PASS, [])))
    recorder.close()
    assert recorded_row(tmp_path, 5)["rerun"] is True and announced == [(5, True)]


def test_the_trl_sink_publishes_through_the_daemons_step_sink(tmp_path: Path) -> None:
    trl = RunSink(
        tmp_path / "trl",
        GuardsConfig(),
        ForensicsConfig(),
        log_samples=0,
        metrics_host="127.0.0.1",
        metrics_port=None,
    )
    trl.start(None, {"trainer": "trl", "args": {}}, {"grpod": "0"}, "cpu")
    try:
        assert type(trl.steps) is StepSink
        assert trl.steps.recorder is trl.recorder and trl.steps.metrics is trl.metrics
        trl.publish(decided(0), None)
    finally:
        trl.close("finished", halted=False)
    assert recorded_row(tmp_path / "trl", 0)["verdict_action"] == "WARN"
    view = RunDir(tmp_path / "trl").read_status()
    assert view is not None and (view["trainer"], view["state"], view["step"]) == (
        "trl",
        "finished",
        0,
    )
    assert view["next_step"] == 1 and view["last_verdict"] == "WARN (accounting: vtc != mask)"

    daemon = Daemon(plan(tmp_path / "run"))
    daemon._start()  # the tiny model, the store, the initial checkpoint; no server
    try:
        assert type(daemon.sink) is type(trl.steps)
        assert daemon.sink.recorder is daemon.recorder and daemon.sink.status is daemon.status
    finally:
        assert daemon._shutdown(EXIT_OK, "done", checkpoint=False) == EXIT_OK


def test_the_loop_steps_in_process(tmp_path: Path) -> None:
    """One step of `grpod run`'s loop without a subprocess: recorded, published, shown."""
    daemon = Daemon(plan(tmp_path))
    daemon._start()
    assert daemon._step() == Action.PASS
    assert daemon._shutdown(EXIT_OK, "done") == EXIT_OK
    assert recorded_row(tmp_path, 0)["outcome"] == "applied"
    values = parse_metrics(generate_latest(daemon.registry).decode())
    assert values["grpod_step"] == 0 and values['grpod_steps_total{outcome="applied"}'] == 1
    view = RunDir(tmp_path).read_status()
    assert view is not None
    assert (view["state"], view["step"], view["next_step"], view["checkpoint_step"]) == (
        "stopped",
        0,
        1,
        1,
    )


def plan(run_dir: Path) -> Plan:
    """A fresh run of the tiny embedded model, two prompts of two completions a step."""
    config = GrpodConfig(
        engine=EngineConfig(threads=1, prompts_per_step=2, group_size=2),
        daemon=DaemonConfig(run_dir=str(run_dir), metrics=False, progress="off"),
    )
    return Plan(config, RunDir(run_dir), "in-process", False, None, None)


PASS = Verdict(Action.PASS, [])


def test_healthy_steps_wait_for_their_burst_and_go_out_in_order() -> None:
    """With a hold, a healthy step's metrics and line wait; a step with a finding sends the
    held ones first, then itself, at once. A held line carries its own step's time."""
    registry = CollectorRegistry()
    announced: list[tuple[int, float | None]] = []
    sink = StepSink(
        NoRecorder(),
        metrics=Metrics(registry, {"grpod": "0", "torch": "2", "transformers": "5"}),
        announce=lambda result, rerun, at: announced.append((result.step, at)),
        hold_seconds=3600.0,
    )
    sink._sent_at = time.monotonic()  # a burst just went out: the hold runs from now
    before = time.time()
    for step in (1, 2):
        sink.publish(decided(step, PASS))
    assert announced == []
    held = parse_metrics(generate_latest(registry).decode())
    assert held["grpod_step"] == 0 and held['grpod_steps_total{outcome="applied"}'] == 0
    sink.publish(decided(3))  # WARN: at once, after the held ones
    assert [step for step, _ in announced] == [1, 2, 3]
    held_at = [at for _, at in announced[:2]]
    assert all(at is not None and before <= at <= time.time() for at in held_at)
    assert announced[2][1] is None  # sent as it was published: stamped as it is written
    values = parse_metrics(generate_latest(registry).decode())
    assert values["grpod_step"] == 3 and values['grpod_steps_total{outcome="applied"}'] == 3
    sink.publish(decided(4, PASS))
    assert [step for step, _ in announced] == [1, 2, 3]
    sink.close()  # what is held goes out
    assert [step for step, _ in announced] == [1, 2, 3, 4]


def test_what_is_held_goes_out_once_the_hold_is_over_without_another_step() -> None:
    """The publish thread sends a burst when no step comes after it (a stall, an eval)."""
    sent = threading.Event()
    sink = StepSink(NoRecorder(), announce=lambda result, rerun, at: sent.set(), hold_seconds=0.2)
    sink._sent_at = time.monotonic()
    sink.publish(decided(1, PASS))
    try:
        assert sent.wait(60), "the held step never went out"
    finally:
        sink.close()
    assert sink._timer is not None and not sink._timer.is_alive()


def test_a_held_line_keeps_its_steps_context_and_time_and_goes_before_any_later_line(
    tmp_path: Path,
) -> None:
    """The daemon's logger sends the held step lines before any other line (its
    `around_write`), each with its own step's `step`, `run_id` and `ts`."""
    out = io.StringIO()
    sink_box: list[StepSink] = []
    log = logs.make_logger("json", "info", stream=out, around_write=lambda: sink_box[0].line_turn())
    sink = StepSink(NoRecorder(), announce=StepConsole(log).announce, hold_seconds=3600.0)
    sink_box.append(sink)
    sink._sent_at = time.monotonic()
    logs.bind_run("run-held", 0)
    try:
        for step in (7, 8):
            with logs.step_context(step):
                sink.publish(decided(step, PASS))
        assert out.getvalue() == ""
        with logs.step_context(9):
            log.info("checkpoint saved")
    finally:
        logs.clear()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["event"], x["step"], x["run_id"]) for x in lines] == [
        ("step", 7, "run-held"),
        ("step", 8, "run-held"),
        ("checkpoint saved", 9, "run-held"),
    ]
    stamps = [datetime.fromisoformat(x["ts"].replace("Z", "+00:00")) for x in lines]
    assert stamps == sorted(stamps) and all(x["ts"].endswith("Z") for x in lines)


def test_a_burst_that_fails_on_the_publish_thread_fails_the_next_step() -> None:
    """A failure in a burst sent beside the trainer is not lost: the next publish raises it
    (the daemon's loop turns it into a failed run, exit 1)."""

    def announce(result: StepResult, rerun: bool, at: float | None) -> None:
        raise OSError(28, "No space left on device")

    sink = StepSink(NoRecorder(), announce=announce, hold_seconds=0.2)
    sink._sent_at = time.monotonic()
    sink.publish(decided(1, PASS))
    assert sink._timer is not None
    sink._timer.join(60)
    assert not sink._timer.is_alive()
    with pytest.raises(OSError, match="No space left"):
        sink.publish(decided(2, PASS))


def test_a_burst_that_fails_after_the_last_step_fails_the_close_once() -> None:
    """The publish thread's burst fails and no publish follows (the run's last step): the
    sink's close raises it. One a publish already raised is not raised again."""

    def announce(result: StepResult, rerun: bool, at: float | None) -> None:
        raise OSError(28, "No space left on device")

    for publish_again in (False, True):
        sink = StepSink(NoRecorder(), announce=announce, hold_seconds=0.2)
        sink._sent_at = time.monotonic()
        sink.publish(decided(1, PASS))
        assert sink._timer is not None
        sink._timer.join(60)
        if publish_again:
            with pytest.raises(OSError, match="No space left"):
                sink.publish(decided(2, PASS))
            sink.close()
        else:
            with pytest.raises(OSError, match="No space left"):
                sink.close()


def test_a_publish_that_fails_at_the_stop_fails_the_run(tmp_path: Path) -> None:
    """The last step's line cannot be written when the loop stops: exit 1, `failed` in the
    status view, the step recorded and the stop checkpoint saved all the same."""
    daemon = Daemon(plan(tmp_path))
    daemon._start()
    assert daemon._step() == Action.PASS  # held: its line waits for a burst

    def announce(result: StepResult, rerun: bool, at: float | None) -> None:
        raise OSError(28, "No space left on device")

    daemon.sink.announce = announce
    assert daemon._shutdown(EXIT_OK, "done") == EXIT_FAILURE
    assert recorded_row(tmp_path, 0)["outcome"] == "applied"
    view = RunDir(tmp_path).read_status()
    assert view is not None and (view["state"], view["exit_code"]) == ("failed", EXIT_FAILURE)
    assert (view["checkpoint_step"], view["next_step"]) == (1, 1)


def test_a_status_file_that_cannot_be_written_is_reported_outside_the_views_lock(
    tmp_path: Path,
) -> None:
    """The daemon logs a failed status write, and a line it logs may send a burst, which
    writes the view: the report comes after the view's lock is let go."""
    (tmp_path / "run").write_text("a file where the run dir should be")
    reported: list[tuple[OSError, bool]] = []

    def on_error(exc: OSError) -> None:
        free = view._writing.acquire(blocking=False)
        if free:
            view._writing.release()
        reported.append((exc, free))

    view = StatusView(RunDir(tmp_path / "run"), "r1", next_step=lambda: 1, on_error=on_error)
    view.write("running")
    assert [(type(exc).__name__, free) for exc, free in reported] == [("NotADirectoryError", True)]
    unreported = StatusView(RunDir(tmp_path / "run"), "r1", next_step=lambda: 1)
    with pytest.raises(NotADirectoryError):
        unreported.write("running")


def test_the_status_view_is_written_with_a_burst_not_by_the_steps_publish(tmp_path: Path) -> None:
    """While a healthy step is held, its publish leaves status.json alone (a file replaced
    costs the trainer ~1 ms on a W1 step); the burst that sends it writes the view, from the
    publish thread, with the latest step and its verdict."""
    view = StatusView(RunDir(tmp_path), "r1", next_step=lambda: 3)
    writers: list[str] = []
    written = threading.Event()
    write = view.write

    def recording_write(state: str, **extra: Any) -> None:
        writers.append(threading.current_thread().name)
        write(state, **extra)
        written.set()

    view.write = recording_write  # type: ignore[method-assign]
    sink = StepSink(NoRecorder(), status=view, hold_seconds=0.2)
    sink._sent_at = time.monotonic()  # a burst just went out: the hold runs from now
    sink.publish(decided(2, PASS))
    assert writers == [] and RunDir(tmp_path).read_status() is None
    assert view.last_step == 2  # the view knows the step; its file waits for the burst
    assert sink._timer is not None
    try:
        assert written.wait(60), "the burst never wrote the view"
    finally:
        sink.close()
    assert writers == ["grpod-publish"]
    shown = RunDir(tmp_path).read_status()
    assert shown is not None and (shown["state"], shown["step"], shown["next_step"]) == (
        "running",
        2,
        3,
    )
    assert shown["last_verdict"] == "PASS"
    view._written = -math.inf  # a second has passed: the view is due
    sink.publish(decided(3))  # a finding goes out at once, on the trainer, with the view
    assert writers == ["grpod-publish", threading.current_thread().name]
    shown = RunDir(tmp_path).read_status()
    assert shown is not None and shown["step"] == 3
    assert shown["last_verdict"] == "WARN (accounting: vtc != mask)"


def test_a_line_logged_while_steps_are_held_starts_below_their_progress_bar() -> None:
    """On a terminal, a line the run logs while steps are held: their burst goes out first
    (redrawing the progress bar), then the bar clears, then the line. Before 2026-12-06 the
    bar cleared first, the burst redrew it, and the line was written on the bar's end."""
    out = io.StringIO()
    progress = Progress(10, stream=out)
    run = SimpleNamespace(sink=None, progress=progress)
    log = logs.make_logger(
        "json", "info", stream=out, around_write=lambda: Daemon._around_line(run)
    )
    sink = StepSink(NoRecorder(), announce=StepConsole(log, progress).announce, hold_seconds=3600.0)
    run.sink = sink
    sink._sent_at = time.monotonic()  # a burst just went out: the hold runs from now
    for step in (1, 2):
        sink.publish(decided(step, PASS))
    assert out.getvalue() == ""
    log.info("checkpoint saved")
    text = out.getvalue()
    bar, line = text.rindex("3/10"), text.index('"checkpoint saved"')  # step 2's bar: 3 done
    cleared = text.rindex("\r\x1b[K", 0, line)
    assert bar < cleared and text[cleared + 4 : line] == '{"event": '
