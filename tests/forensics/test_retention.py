"""Retention (`gc` within a budget), fsck, and the incidents / db commands of the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import delete, select, text

from grpod.daemon.cli import main
from grpod.engine import TransportBatch
from grpod.forensics import ForensicsError, Store, fsck, gc, replay
from grpod.forensics.models import Blob, Step
from tests.forensics.campaign import stand_in_run_json
from tests.forensics.conftest import FAULT_STEP, blob_rows, damage_blob


def blob_count(run_dir: Path) -> int:
    """Blob rows; every file-backed one has its file, and no other file is there."""
    rows = blob_rows(run_dir)
    files = sorted(p for p in rows.values() if p)
    folder = run_dir / "blobs" / "sha256"
    on_disk = (
        sorted(str(p.relative_to(run_dir)) for p in folder.iterdir()) if folder.is_dir() else []
    )
    assert on_disk == files
    return len(rows)


def test_gc_keeps_incident_pins_and_the_newest_checkpoint(
    run_copy: Path, capsys: pytest.CaptureFixture
) -> None:
    assert blob_count(run_copy) == 13
    roomy = gc(run_copy, budget_bytes=1 << 40)
    assert (roomy.blobs_deleted, roomy.checkpoints_deleted) == (0, [])
    planned = gc(run_copy, budget_bytes=0, dry_run=True)
    assert blob_count(run_copy) == 13 and (run_copy / "checkpoints/step-00000000").is_dir()
    done = gc(run_copy, budget_bytes=0)
    assert (done.blobs_deleted, done.checkpoints_deleted) == (planned.blobs_deleted, [0])
    assert done.blobs_deleted == 7  # steps 0-4, 8, 9: outside retention, not pinned
    assert not (run_copy / "checkpoints/step-00000000").exists()
    assert (run_copy / "checkpoints/step-00000005").is_dir()  # pinned by the incident
    assert blob_count(run_copy) == 6 and done.kept_bytes > 0
    assert fsck(run_copy).ok
    assert replay(run_copy, incident_id=1).reproduced
    assert replay(run_copy, step=12).reproduced
    assert main(["replay", "--run-dir", str(run_copy), "--step", "9"]) == 2
    assert capsys.readouterr().err == (
        "grpod replay: error: step 9: cannot be rebuilt: replay starts from checkpoint step 5 "
        "and re-runs steps 5-8, but the batch blob of step 8 was pruned or never recorded\n"
    )
    shutil.rmtree(run_copy / "checkpoints/step-00000010")
    with pytest.raises(ForensicsError) as refused:
        replay(run_copy, step=12)
    assert str(refused.value) == (
        "step 12: cannot be rebuilt: checkpoint step 10 was pruned or removed, so replay starts "
        "from checkpoint step 5 and re-runs steps 5-11, but the batch blob of step 8 was pruned "
        "or never recorded"
    )


def test_gc_keeps_the_newest_checkpoints_and_the_pinned_ones(run_copy: Path) -> None:
    before = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    kept = gc(run_copy, budget_bytes=1 << 40, keep_checkpoints=1)
    after = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    assert kept.checkpoints_deleted == [0] and "step-00000000" in before
    assert after == [name for name in before if name != "step-00000000"]
    assert kept.freed_bytes > 0 and fsck(run_copy).ok
    assert replay(run_copy, incident_id=1).reproduced


def test_fsck_names_a_step_whose_batch_is_gone_not_one_a_live_gc_just_pruned(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run's retention can commit between fsck's read of the checkpoints and its read
    of the steps: the old start with the batches before the new one gone is read again, not
    reported. A batch gone from the retention start on is."""
    checkpoints, pruned = Store.checkpoints, []

    def read_then_the_live_run_prunes(self, session, **kwargs):
        rows = checkpoints(self, session, **kwargs)
        if not pruned:  # the live run's retention, right after fsck read the checkpoints
            pruned.append(None)  # (gc reads the checkpoints too)
            pruned[0] = gc(run_copy, budget_bytes=1 << 40, keep_checkpoints=1)
        return rows

    monkeypatch.setattr(Store, "checkpoints", read_then_the_live_run_prunes)
    report = fsck(run_copy)
    assert pruned[0].checkpoints_deleted == [0] and pruned[0].blobs_deleted > 0
    assert report.ok, report.problems
    monkeypatch.undo()

    store = Store(run_copy, create=False)
    with store.session() as session:  # step 12's batch row gone (a damaged store)
        digest = session.scalar(select(Step.batch_digest).where(Step.step == 12))
        session.execute(delete(Blob).where(Blob.sha256 == digest))
        session.commit()
    store.close()
    assert "1 steps from step 10 on name a missing batch (first: 12)" in fsck(run_copy).problems


def test_a_pinned_checkpoint_in_the_window_keeps_the_steps_after_it(run_copy: Path) -> None:
    """Checkpoints 5 (pinned by the incident) and 10 are the newest two: with
    keep_checkpoints = 2 both replay the steps after them, so steps 8 and 9 stay (the run's
    only earlier checkpoint being pinned does not make them unreplayable)."""
    import shutil

    store = Store(run_copy)  # checkpoint 0 deleted as retention deletes one: row, then files
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE checkpoints SET deleted = TRUE WHERE step = 0"))
    store.close()
    shutil.rmtree(run_copy / "checkpoints/step-00000000")
    kept = gc(run_copy, budget_bytes=1 << 40, keep_checkpoints=2)
    assert kept.checkpoints_deleted == [] and kept.blobs_deleted == 5  # steps 0-4 only
    assert replay(run_copy, step=9).reproduced
    assert replay(run_copy, incident_id=1).reproduced and fsck(run_copy).ok


def test_fsck_names_a_damaged_blob(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    digest = sorted(blob_rows(run_copy))[0]
    damage_blob(run_copy, digest)
    report = fsck(run_copy)
    assert [p.split(":")[0] for p in report.problems] == [f"blob {digest}"]
    assert main(["fsck", "--run-dir", str(run_copy)]) == 1
    assert "digest mismatch" in capsys.readouterr().out


def test_incidents_commands(run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["incidents", "list", "--run-dir", str(run_copy), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["id"], row["step"], row["guards"]) == (1, FAULT_STEP, ["nonfinite"])
    assert main(["incidents", "show", "1", "--run-dir", str(run_copy)]) == 0
    assert "nonfinite" in capsys.readouterr().out
    out = tmp_path / "handover"
    assert main(["incidents", "export", "1", str(out), "--run-dir", str(run_copy)]) == 0
    batch = TransportBatch.load(out / "batch.safetensors")
    exported = json.loads((out / "incident.json").read_text())
    assert batch.step == FAULT_STEP == exported["report"]["step"]
    assert exported["findings"][0]["guard"] == "nonfinite" and "engine" in exported["config"]
    assert main(["incidents", "export", "1", str(out), "--run-dir", str(run_copy)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["incidents", "show", "9", "--run-dir", str(run_copy)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"grpod incidents: error: incident 9: no such incident in {run_copy.resolve()}"
    )
    with pytest.raises(SystemExit) as refused:
        main(["incidents", "show", "1", "--samples", "-1", "--run-dir", str(run_copy)])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (  # one line, as every refusal
        "grpod incidents show: error: argument --samples: must be >= 0: -1 "
        "(see grpod incidents show --help)\n"
    )


def test_db_upgrade_and_gc_commands(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "fresh"
    assert main(["db", "upgrade", "--run-dir", str(run_dir)]) == 0
    assert "revision 0008_incident_samples" in capsys.readouterr().out
    assert main(["gc", "--run-dir", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["within_budget"] is True
    assert main(["fsck", "--run-dir", str(tmp_path / "missing")]) == 2
    assert "not a grpod run directory (no run.json)" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    stand_in_run_json(run_dir, "r")  # a run dir's, as `grpod run` writes it beside the store
    store = Store(run_dir)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
    store.close()
    before = (run_dir / "grpod.sqlite").read_bytes()
    for command in (["db", "upgrade"], ["incidents", "list"], ["replay", "--step", "0"]):
        assert main([*command, "--run-dir", str(run_dir)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "schema revision f00d is newer than this grpod" in line
    assert (run_dir / "grpod.sqlite").read_bytes() == before
