"""The store on SQLite and PostgreSQL: migrations, schema checks, recorded rows."""

from __future__ import annotations

import json
import math
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, insert, select, text

from grpod.engine import Outcome, StepReport, StepResult, TransportBatch, Verdict
from grpod.engine.context import ExecutionContext
from grpod.engine.train.stats import mismatch_stats
from grpod.forensics import BlobStore, FlightRecorder, ForensicsConfig, ForensicsError, Store
from grpod.forensics.models import Base, Blob, Checkpoint, Incident, PromptFate, Run, Step
from grpod.forensics.store import NotedCheckpoint, RunSummary
from tests.batches import make_batch
from tests.reports import make_report


def tiny_batch(step: int) -> TransportBatch:
    shape = (1, 2, 8)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[..., 4:] = True
    return make_batch(
        loss_mask=mask,
        input_ids=torch.arange(16).reshape(shape) + step,
        position_ids=torch.arange(8).repeat(1, 2, 1),
        advantages=torch.full(shape, 0.5),
        sample_ids=torch.zeros(shape, dtype=torch.int32),
        rewards=torch.tensor([1.0, 0.0]),
        completion_lengths=torch.tensor([4, 4], dtype=torch.int32),
        step=step,
    )


def decided(
    batch: TransportBatch,
    report: StepReport,
    verdict: dict[str, Any],
    outcome: str,
    context: ExecutionContext | None = None,
) -> StepResult:
    """A decided step as the daemon hands it to the recorder, from a verdict dict; `context`:
    the engine's execution context it ran under."""
    verdict_ = Verdict.from_dict(verdict)
    return StepResult(batch, report, verdict_, Outcome(outcome), {}, context=context)


def tiny_report(step: int, loss: float = 0.25) -> StepReport:
    return make_report(
        step=step,
        valid_tokens=8,
        expected_valid_tokens=8,
        loss=loss,
        micro_losses=[loss],
        grad_norm=1.5,
        clip_coef=0.66,
        zero_std_group_fraction=0.0,
        advantage_abs_max=0.5,
        completion_length_mean=4.0,
        num_micros=1,
        micro_order=[0],
        **mismatch_stats(None, None),  # a step without sampler logprobs
    )


def record_steps(run_dir: Path, store_url: str, verdicts: list[dict], **config) -> FlightRecorder:
    recorder = FlightRecorder(run_dir, ForensicsConfig(store_url=store_url, **config))
    recorder.start_run("r1", {"engine": {}, "guards": {}}, {"torch": torch.__version__}, "cpu")
    recorder.note_checkpoint(0, run_dir / "checkpoints" / "step-00000000")
    for step, verdict in enumerate(verdicts):
        loss = math.nan if verdict["action"] == "FLUSH" else 0.25
        outcome = "flushed" if verdict["action"] == "FLUSH" else "applied"
        recorder.record(decided(tiny_batch(step), tiny_report(step, loss), verdict, outcome))
    recorder.close()
    return recorder


PASS = {"action": "PASS", "findings": []}
WARN = {"action": "WARN", "findings": [{"guard": "g", "action": "WARN", "message": "m"}]}
FLUSH = {"action": "FLUSH", "findings": [{"guard": "nan", "action": "FLUSH", "message": "x"}]}


def test_upgrade_is_idempotent_and_matches_the_models(tmp_path: Path, store_url: str) -> None:
    store = Store(tmp_path, store_url)
    assert store.revision() is None
    head = store.upgrade()
    assert store.upgrade() == head == store.revision()
    store.check_schema()
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"migrations and models disagree: {diff}"
    store.close()


def _migrate(store: Store, verb: str, revision: str) -> None:
    from alembic import command

    config, _ = store._alembic()
    with store.engine.begin() as conn:
        config.attributes["connection"] = conn
        getattr(command, verb)(config, revision)


def test_a_store_of_file_blobs_upgrades_and_inline_blobs_refuse_a_downgrade(
    tmp_path: Path, store_url: str
) -> None:
    store = Store(tmp_path, store_url)
    _migrate(store, "upgrade", "0001")  # a store written by the grpod before inline blobs
    store.close()
    # this grpod needs the head
    with pytest.raises(ForensicsError, match="older than 0008_incident_samples"):
        FlightRecorder(tmp_path, ForensicsConfig(store_url=store_url), upgrade=False)
    store = Store(tmp_path, store_url)  # a blob file and its row, as 0001 wrote them
    digest, size = BlobStore(tmp_path).write(tiny_batch(5).tensors(), tiny_batch(5).metadata())
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO blobs (sha256, size, kind, path, created_at) "
                "VALUES (:d, :s, 'batch', :p, CURRENT_TIMESTAMP)"
            ),
            {"d": digest, "s": size, "p": f"blobs/sha256/{digest}"},
        )
    assert store.upgrade() == "0008_incident_samples"
    with store.session() as session:
        blob = session.get(Blob, digest)
        assert blob.data is None and blob.path == f"blobs/sha256/{digest}"
        BlobStore(tmp_path).verify(digest, blob.data)  # still read from its file
    store.close()

    recorder = record_steps(tmp_path, store_url, [PASS])  # an inline blob now
    store = Store(tmp_path, store_url, create=False)
    with pytest.raises(Exception, match="stored inline; nothing changed"):
        _migrate(store, "downgrade", "0001")
    # nothing changed: the downgrade rolled back whole
    assert store.revision() == "0008_incident_samples"
    with store.session() as session:
        assert session.scalar(select(func.count()).where(Blob.data.is_not(None))) == 1
    store.close()
    assert recorder.recorded_total == 1


def test_every_report_scalar_has_a_column() -> None:
    assert set(StepReport.SCALARS) <= set(Step.__table__.columns.keys())


def test_recorded_rows_round_trip(tmp_path: Path, store_url: str) -> None:
    recorder = record_steps(tmp_path, store_url, [PASS, WARN, FLUSH])
    assert (recorder.recorded_total, recorder.incidents_total) == (3, 2)
    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        steps = session.scalars(select(Step).order_by(Step.step)).all()
        assert [s.outcome for s in steps] == ["applied", "applied", "flushed"]
        assert [s.verdict_action for s in steps] == ["PASS", "WARN", "FLUSH"]
        assert steps[0].loss == 0.25 and steps[0].kl is None
        assert math.isnan(StepReport.from_dict(json.loads(steps[2].report_json)).loss)
        assert steps[2].loss is None or math.isnan(steps[2].loss)  # SQLite keeps NaN as NULL
        assert {s.batch_digest for s in steps} == set(session.scalars(select(Blob.sha256)))
        incidents = store.incidents(session)
        assert [(i.step, i.action) for i in incidents] == [(1, "WARN"), (2, "FLUSH")]
        assert json.loads(incidents[1].findings_json)[0]["guard"] == "nan"
        checkpoint = session.scalars(select(Checkpoint)).one()
        assert checkpoint.pinned and incidents[0].checkpoint_id == checkpoint.id
        assert checkpoint.path == "checkpoints/step-00000000"  # relative: the run dir can move
        run = session.get(Run, "r1")
        assert run.ended_at is not None and json.loads(run.config_json)["guards"] == {}
    store.close()


def test_rows_insert_stores_what_sqlalchemy_stores(tmp_path: Path, store_url: str) -> None:
    """The recorder's inserts (`RowsInsert`: the driver's executemany, a shared value processed
    once) store what SQLAlchemy's executemany stores: aware timestamps shared by some rows and
    not others, booleans, NULLs, bytes; a blob digest the store has keeps its first row."""
    store = Store(tmp_path, store_url)
    store.upgrade()
    now = datetime(2026, 12, 5, 17, 1, 28, 123456, tzinfo=timezone.utc)
    later = now + timedelta(seconds=1.5)
    with store.session() as session:
        session.add_all(
            Run(
                id=run,
                run_dir=str(tmp_path),
                config_json="{}",
                config_digest="0" * 64,
                versions_json="{}",
                device="cpu",
                started_at=now,
                ended_at=None,
            )
            for run in ("fast", "plain")
        )

    def prompts(run: str) -> list[dict[str, Any]]:
        return [
            dict(
                run_id=run,
                step=i // 2,
                fate="trained",
                prompt_id=i,
                epoch=None if i % 2 else 3,
                epoch_size=512,
                task_row=i,
                generation_pass=0,
                rank=0,
                stale_drops=i,
                reason="nan/loss" if i % 3 else "",
                superseded=bool(i % 2),
                recorded_at=now if i < 3 else later,
            )
            for i in range(5)
        ]

    def blob(digest: str, data: bytes) -> dict[str, Any]:
        return dict(sha256=digest, size=len(data), kind="batch", path="", data=data, created_at=now)

    keeping = store.insert_keeping(Blob, "sha256")
    fast_blobs, fast_prompts = store.rows_insert(keeping), store.rows_insert(insert(PromptFate))
    with store.session() as session:
        conn = session.connection()
        fast_prompts(conn, prompts("fast"))
        conn.execute(insert(PromptFate), prompts("plain"))
        fast_blobs(conn, [blob("a" * 64, b"\x00first"), blob("b" * 64, b"")])
        fast_blobs(conn, [blob("a" * 64, b"second")])  # the store has it: the first is kept
        fast_prompts(conn, [])  # nothing to insert: no statement
        lacking = [{k: v for k, v in prompts("fast")[0].items() if k != "superseded"}]
        with pytest.raises(ValueError, match="superseded"):  # a default it would not fill in
            fast_prompts(conn, lacking)
    columns = [c for c in PromptFate.__table__.columns if c.name not in ("id", "run_id")]
    with store.session() as session:
        got = {
            run: session.execute(
                select(*columns).where(PromptFate.run_id == run).order_by(PromptFate.prompt_id)
            ).all()
            for run in ("fast", "plain")
        }
        blobs = session.execute(select(Blob.sha256, Blob.data).order_by(Blob.sha256)).all()
    store.close()
    assert got["fast"] == got["plain"] and len(got["fast"]) == 5
    stamps = [row.recorded_at.replace(tzinfo=timezone.utc) for row in got["fast"]]
    assert stamps == [now] * 3 + [later] * 2  # SQLite reads them back naive, in UTC
    assert [row.superseded for row in got["fast"]] == [False, True, False, True, False]
    assert [(d, bytes(data)) for d, data in blobs] == [("a" * 64, b"\x00first"), ("b" * 64, b"")]


def test_a_batch_recorded_again_keeps_its_first_blob_row(tmp_path: Path, store_url: str) -> None:
    """A digest the store has (a resumed run's rerun of a step, in the same commit group or a
    later one) keeps one blob row, the first; every step row names it."""
    config = ForensicsConfig(store_url=store_url, inline_blob_bytes=0)  # files: a path to keep
    recorder = FlightRecorder(tmp_path, config)
    recorder.start_run("r1", {"engine": {}}, {}, "cpu")
    recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"))
    recorder.drain()  # committed: the next two find its row
    recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"), rerun=True)
    recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"), rerun=True)
    recorder.close()
    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        (blob,) = session.scalars(select(Blob)).all()
        steps = session.scalars(select(Step).order_by(Step.id)).all()
        assert [(s.step, s.rerun, s.batch_digest) for s in steps] == [
            (0, False, blob.sha256),
            (0, True, blob.sha256),
            (0, True, blob.sha256),
        ]
        assert blob.path == BlobStore(tmp_path).relpath(blob.sha256) and blob.data is None
        BlobStore(tmp_path).verify(blob.sha256)
    store.close()


def test_incident_action_threshold(tmp_path: Path, store_url: str) -> None:
    recorder = record_steps(tmp_path, store_url, [PASS, WARN, FLUSH], incident_action="FLUSH")
    assert recorder.incidents_total == 1


def test_newer_schema_is_refused_and_left_alone(tmp_path: Path, store_url: str) -> None:
    store = Store(tmp_path, store_url)
    store.upgrade()
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    for action in (store.check_schema, store.upgrade):
        with pytest.raises(ForensicsError, match="newer than this grpod"):
            action()
    assert store.revision() == "9999"
    with pytest.raises(ForensicsError, match="newer"):
        FlightRecorder(tmp_path, ForensicsConfig(store_url=store_url))
    store.close()


def test_empty_store_is_refused_by_readers(tmp_path: Path, store_url: str) -> None:
    store = Store(tmp_path, store_url)
    with pytest.raises(ForensicsError, match="grpod db upgrade"):
        store.check_schema()
    store.close()


def test_missing_sqlite_store_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(ForensicsError, match="no such file"):
        Store(tmp_path / "nowhere", create=False)
    assert not (tmp_path / "nowhere").exists()


def test_sqlite_settings(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.upgrade()
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 10_000
    store.close()
    assert (tmp_path / "grpod.sqlite").is_file()
    with sqlite3.connect(tmp_path / "grpod.sqlite") as conn:  # foreign keys are enforced
        conn.execute("PRAGMA foreign_keys=ON")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT INTO checkpoints (run_id, step, path, pinned, deleted, created_at) "
                "VALUES ('no-such-run', 0, 'x', 0, 0, '2026-01-01')"
            )


@pytest.mark.postgres
def test_shared_store_scopes_runs_by_run_dir(tmp_path: Path, pg_store_url: str) -> None:
    store_url = pg_store_url
    record_steps(tmp_path / "a", store_url, [WARN])
    recorder = FlightRecorder(tmp_path / "b", ForensicsConfig(store_url=store_url))
    recorder.start_run("r2", {"engine": {}}, {}, "cpu")
    recorder.close()
    store = Store(tmp_path / "b", store_url)
    with store.session() as session:
        assert store.run_ids(session) == ["r2"]
        assert store.incidents(session) == []
        assert len(session.scalars(select(Incident)).all()) == 1
    store.close()


def test_typed_reads_of_a_run_dir(tmp_path: Path, store_url: str) -> None:
    """What the daemon, `grpod status` and `grpod plot` read, without SQL of their own."""
    empty = tmp_path / "empty"
    FlightRecorder(empty, ForensicsConfig(store_url=store_url)).close()
    store = Store(empty, store_url, create=False)
    assert store.last_recorded_step() is None and store.step_points() == []
    assert store.summary() == RunSummary({}, 0, None, None, None, ())
    store.close()

    record_steps(tmp_path, store_url, [PASS, WARN, FLUSH])
    recorder = FlightRecorder(tmp_path, ForensicsConfig(store_url=store_url))
    recorder.start_run("r1", {"engine": {}, "guards": {}}, {}, "cpu")  # resumed: step 2 again
    recorder.record(decided(tiny_batch(2), tiny_report(2, loss=0.5), PASS, "applied"), rerun=True)
    recorder.close()
    store = Store(tmp_path, store_url, create=False)
    assert store.last_recorded_step() == 2
    assert store.noted_checkpoints() == [
        NotedCheckpoint(0, tmp_path.resolve() / "checkpoints" / "step-00000000")
    ]
    points = store.step_points()
    assert [(p.step, p.outcome, p.loss) for p in points] == [
        (0, "applied", 0.25),
        (1, "applied", 0.25),
        (2, "applied", 0.5),  # the re-run's record replaces the flushed one
    ]
    assert (points[0].valid_tokens, points[0].expected_valid_tokens) == (8, 8)
    assert (points[0].grad_norm, points[0].reward_mean) == (1.5, tiny_report(0).reward_mean)
    assert [(m.step, m.action) for m in store.incident_marks()] == [(1, "WARN"), (2, "FLUSH")]
    assert store.summary() == RunSummary(
        outcomes={"applied": 3, "flushed": 1},
        reruns=1,
        last_step=2,
        last_outcome="applied",
        last_verdict_action="PASS",
        incident_steps=(1, 2),
    )
    store.close()
