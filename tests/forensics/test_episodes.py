"""Incidents are episodes: one per (guard, kind) over consecutive steps, in a real store."""

from __future__ import annotations

from pathlib import Path

from grpod.forensics import FlightRecorder, ForensicsConfig, Store, list_incidents
from grpod.forensics.episodes import EpisodeTracker
from tests.forensics.test_store import PASS, decided, record_steps, tiny_batch, tiny_report


def warn(guard: str = "advantage", kind: str = "all_zero", severity: float = 0.0) -> dict:
    finding = {"guard": guard, "action": "WARN", "message": "m", "kind": kind}
    finding["evidence"] = {"severity": severity}
    return {"action": "WARN", "findings": [finding]}


def test_tracker_opens_extends_worsens_and_closes_after_the_gap() -> None:
    tracker = EpisodeTracker("WARN", gap_steps=2)
    seen = tracker.observe(0, warn()["findings"])
    (episode,) = seen.opened
    assert tracker.observe(1, warn(severity=3.0)["findings"]).worse == [episode]
    assert tracker.observe(2, warn(severity=1.0)["findings"]).worse == []
    assert not tracker.observe(3, []).touched and not tracker.observe(4, []).touched
    assert tracker.observe(5, []).touched == [episode] and episode.closed  # 3 steps without
    assert (episode.first_step, episode.last_step, episode.steps, episode.worst_step) == (
        0,
        2,
        3,
        1,
    )
    assert tracker.observe(5, warn()["findings"]).opened == []  # a re-run of step 5
    assert tracker.observe(6, warn()["findings"]).opened  # a new episode
    assert tracker.observe(7, [{"guard": "g", "action": "PASS", "message": ""}]).opened == []


def test_a_long_warn_is_one_incident_pinning_first_and_worst(tmp_path: Path) -> None:
    verdicts = [PASS] + [warn(severity=float(s == 7)) for s in range(1, 40)] + [PASS] * 20
    verdicts[10] = {"action": "WARN", "findings": warn()["findings"] + warn("spike")["findings"]}
    recorder = record_steps(tmp_path, "", verdicts, episode_gap_steps=4)
    rows = list_incidents(tmp_path)
    assert [(r["guard"], r["step"], r["last_step"], r["steps"], r["status"]) for r in rows] == [
        ("advantage", 1, 39, 39, "closed"),
        ("spike", 10, 10, 1, "closed"),
    ]
    assert rows[0]["worst_step"] == 7
    assert (recorder.incidents_total, recorder.incident_steps_total) == (2, 39)


def test_an_episode_a_crash_left_open_continues_after_the_resume(tmp_path: Path) -> None:
    config = ForensicsConfig(episode_gap_steps=4)
    first = FlightRecorder(tmp_path, config)
    first.start_run("r1", {"engine": {}}, {}, "cpu")
    for step in range(5):
        first.record(decided(tiny_batch(step), tiny_report(step), warn(), "applied"))
    first.drain()  # committed, then the process dies without close()
    assert list_incidents(tmp_path)[0]["status"] == "open"
    second = FlightRecorder(tmp_path, config)
    second.start_run("r1", {"engine": {}}, {}, "cpu")
    assert second.open_incidents == 1
    for step in range(3, 8):  # 3 and 4 re-run (already counted), 5-7 new
        second.record(
            decided(tiny_batch(step), tiny_report(step), warn(), "applied"), rerun=step < 5
        )
    second.close()
    (row,) = list_incidents(tmp_path)
    assert (row["step"], row["last_step"], row["steps"], row["status"]) == (0, 7, 8, "closed")


def test_a_moving_worst_step_keeps_only_its_latest_checkpoint_pinned(tmp_path: Path) -> None:
    """Entropy falling step after step: each step is the worst so far, and only the first
    step's checkpoint and the latest worst step's stay pinned, not every one in between."""
    recorder = FlightRecorder(tmp_path, ForensicsConfig())
    recorder.start_run("r1", {"engine": {}}, {}, "cpu")
    for step in range(36):
        if step % 10 == 0:
            recorder.note_checkpoint(step, tmp_path / "checkpoints" / f"step-{step:08d}")
        verdict = warn("entropy", "drop", severity=step / 100) if step else PASS
        recorder.record(decided(tiny_batch(step), tiny_report(step), verdict, "applied"))
    recorder.close()
    store = Store(tmp_path, create=False)
    with store.session() as session:
        pinned = [c.step for c in store.checkpoints(session) if c.pinned]
    store.close()
    assert pinned == [0, 30]
    (row,) = list_incidents(tmp_path)
    assert (row["step"], row["worst_step"], row["steps"]) == (1, 35, 35)
