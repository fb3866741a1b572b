"""The StepSink in process (daemon/sink.py): a decided step, built by hand, is recorded by the
flight recorder, published on the registry and shown in the status view; `grpod run`'s loop
and the TRL trainer publish through the same class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from grpod.daemon.config import DaemonConfig, GrpodConfig
from grpod.daemon.exitcodes import EXIT_OK
from grpod.daemon.health import Health
from grpod.daemon.loop import Daemon
from grpod.daemon.metrics import Metrics, RankMetrics
from grpod.daemon.rundir import Plan, RunDir
from grpod.daemon.sink import StepSink
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
        announce=lambda result, rerun: announced.append((result.step, rerun)),
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
    sink = StepSink(recorder, announce=lambda r, rerun: announced.append((r.step, rerun)))
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
