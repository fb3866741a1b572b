"""The daemon's retention pass over budget: judged at the run dir's peak (right after a
checkpoint, before its prune), said once in a warning naming the bytes over and the pins, and
at every pass in `grpod_retention_over_budget_bytes`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from grpod.daemon.metrics import Metrics
from grpod.daemon.retention import Retention
from grpod.forensics import FlightRecorder, ForensicsConfig, gc
from tests.forensics.campaign import Campaign
from tests.forensics.conftest import recorded  # noqa: F401 (the fixture)

OVER = "grpod_retention_over_budget_bytes"


@pytest.fixture
def run_copy(recorded: Campaign, tmp_path: Path) -> Path:  # noqa: F811
    """A private copy of the recorded campaign's run dir."""
    return Path(shutil.copytree(recorded.run_dir, tmp_path / "run"))


def _apply(run_dir: Path, retention: Retention, metrics: Metrics) -> list[dict]:
    recorder = FlightRecorder(run_dir, retention.config)
    try:
        with capture_logs() as logs:
            retention.apply(recorder, metrics, structlog.get_logger())
    finally:
        recorder.store.close()
    return [e for e in logs if e["event"] == "over retention budget"]


def test_a_peak_over_budget_is_told_even_when_pruning_gets_back_under(run_copy: Path) -> None:
    """The recorded campaign: checkpoints 0, 5 (pinned by the incident at step 7) and 10. With
    keep_checkpoints = 1 retention may keep only checkpoints 5 and 10, their batches and the
    store; a budget of exactly that is met after the prune but not at the peak before it."""
    gc(run_copy, budget_bytes=1 << 40)  # nothing to delete; the WAL folded into the store
    floor = gc(run_copy, budget_bytes=0, keep_checkpoints=1, dry_run=True)
    assert floor.checkpoints_deleted == [0] and floor.before_bytes > floor.kept_bytes
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    retention = Retention(ForensicsConfig(keep_checkpoints=1, retention_bytes=floor.kept_bytes))

    [warning] = _apply(run_copy, retention, metrics)
    over = floor.before_bytes - floor.kept_bytes
    assert warning["log_level"] == "warning"
    assert warning["over_budget_bytes"] == over
    assert (warning["peak_bytes"], warning["kept_bytes"]) == (floor.before_bytes, floor.kept_bytes)
    assert warning["budget_bytes"] == floor.kept_bytes
    assert (warning["newest_checkpoint"], warning["pinned_checkpoints"]) == (10, [5])
    assert warning["incidents"] == 1
    assert "step 10" in warning["reason"] and "at steps 5" in warning["reason"]
    assert registry.get_sample_value(OVER) == over
    assert not (run_copy / "checkpoints/step-00000000").exists()


def test_within_budget_says_nothing_and_the_gauge_is_zero(run_copy: Path) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    retention = Retention(ForensicsConfig(keep_checkpoints=1, retention_bytes=1 << 40))
    assert _apply(run_copy, retention, metrics) == []
    assert registry.get_sample_value(OVER) == 0
    assert registry.get_sample_value("grpod_retained_bytes") > 0


def test_pins_over_budget_warn_once_and_the_gauge_stays(run_copy: Path) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    retention = Retention(ForensicsConfig(keep_checkpoints=1, retention_bytes=1024))
    [warning] = _apply(run_copy, retention, metrics)
    assert warning["kept_bytes"] > 1024 and warning["pinned_checkpoints"] == [5]
    assert _apply(run_copy, retention, metrics) == []  # once per crossing
    kept = registry.get_sample_value("grpod_retained_bytes")
    assert registry.get_sample_value(OVER) == kept - 1024 > 0  # nothing left to prune: peak = kept
