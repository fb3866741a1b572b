"""The flight recorder: bounded queue that blocks (counted) and never drops; failures surface."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select

from grpod.engine import Engine, EngineConfig, StepReport
from grpod.forensics import FlightRecorder, ForensicsConfig, ForensicsError, Store
from grpod.forensics.models import Run, Step
from tests.forensics.test_store import PASS, decided, tiny_batch, tiny_report


def test_full_queue_blocks_and_counts_never_drops(tmp_path: Path) -> None:
    # a writer slower than the loop: a blob file, its fsync and a commit for every step
    config = ForensicsConfig(queue_size=1, commit_every_steps=1, inline_blob_bytes=0)
    recorder = FlightRecorder(tmp_path, config)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    depths = []
    for step in range(12):
        recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
        depths.append(recorder.queue_depth)
    recorder.close()
    assert max(depths) <= 1
    assert recorder.blocked_total > 0
    assert recorder.recorded_total == 12
    store = Store(tmp_path, create=False)
    with store.session() as session:
        assert session.scalar(select(func.count()).select_from(Step)) == 12
    store.close()


def test_bad_calls_are_refused(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path)
    with pytest.raises(ForensicsError, match="before start_run"):
        recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"))
    recorder.close()


def test_writer_failure_surfaces_and_never_hangs_the_trainer(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, ForensicsConfig(queue_size=1))
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    with recorder.store.session() as session:  # the step rows' run vanishes: inserts fail
        session.execute(delete(Run))
    with pytest.raises(ForensicsError, match="flight recorder failed"):
        for step in range(20):
            recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
        recorder.drain()
    with pytest.raises(ForensicsError, match="flight recorder failed"):
        recorder.close()


def test_a_halt_verdict_is_recorded_as_an_incident(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path)
    recorder.start_run("r", {"engine": {}}, {}, "cpu")
    halt = {"action": "HALT", "findings": [{"guard": "finite", "action": "HALT", "message": "x"}]}
    recorder.record(decided(tiny_batch(0), tiny_report(0), halt, "flushed"))
    recorder.close()
    assert recorder.incidents_total == 1
    store = Store(tmp_path, create=False)
    with store.session() as session:
        (incident,) = store.incidents(session)
        assert incident.action == "HALT" and incident.checkpoint_id is None
    store.close()


def test_the_recorded_report_is_a_json_ready_copy() -> None:
    """The recorder's snapshot, `StepReport.to_dict()`, is plain JSON (NaN and ±inf as
    strings), shares no container with the report, and reads back equal."""
    engine = Engine(EngineConfig(threads=1, sequence_chunks=2, prompts_per_step=2, group_size=2))
    report = engine.accumulate(engine.rollout())
    engine.flush()
    snapshot = report.to_dict()
    assert report.chunk_trace and snapshot["chunk_trace"][0] == asdict(report.chunk_trace[0])
    report.micro_order.append(99)  # the trainer moves on; the writer's copy does not
    assert 99 not in snapshot["micro_order"]
    report = replace(report, loss=math.nan, micro_losses=[math.inf, -math.inf], kl=None)
    snapshot = report.to_dict()
    text = json.dumps(snapshot, allow_nan=False)
    assert (snapshot["loss"], snapshot["micro_losses"]) == ("nan", ["inf", "-inf"])
    back = StepReport.from_dict(json.loads(text))
    assert math.isnan(back.loss) and back.micro_losses == [math.inf, -math.inf]
    assert replace(back, loss=0.0) == replace(report, loss=0.0)
