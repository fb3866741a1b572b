"""A distributed step's `step_ranks` rows: recorded with the step, sliced from its one blob,
pinned with it, checked by fsck, read by `incidents show` and `replay --rank`, migrated in."""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from sqlalchemy import delete, func, inspect, select, text, update

from grpod.base.jsonsafe import to_json
from grpod.daemon.cli import main
from grpod.engine import Engine, EngineConfig, StepReport, TransportBatch
from grpod.engine.report import RankReport
from grpod.forensics import FlightRecorder, ForensicsConfig, ForensicsError, Store, fsck, gc, replay
from grpod.forensics.incidents import incident_batch
from grpod.forensics.models import Blob, Step, StepRank
from tests.batches import make_batch
from tests.forensics.campaign import TINY, stand_in_run_json
from tests.forensics.test_store import PASS, _migrate, decided, tiny_batch, tiny_report
from tests.reports import make_report

FLUSH = {"action": "FLUSH", "findings": [{"guard": "nan", "action": "FLUSH", "message": "x"}]}
RANK_MICROS = (1, 2)  # rank 0 runs one micro, rank 1 two: the ranges are not alike


def rank_batch(step: int, micros: int, offset: int) -> TransportBatch:
    """`micros` micros of 2 rows of 8 tokens, one sample a row, its last 4 tokens trained."""
    shape, samples = (micros, 2, 8), 2 * micros
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[..., 4:] = True
    sample_ids = torch.arange(samples, dtype=torch.int32).reshape(micros, 2, 1).expand(shape)
    return make_batch(
        loss_mask=mask,
        input_ids=torch.arange(micros * 16).reshape(shape) + offset,
        position_ids=torch.arange(8).repeat(micros, 2, 1),
        advantages=torch.full(shape, 0.5),
        sample_ids=sample_ids.contiguous(),
        rewards=torch.arange(samples, dtype=torch.float32) + offset,
        completion_lengths=torch.full((samples,), 4, dtype=torch.int32),
        step=step,
    )


def distributed_step(
    step: int, local_losses: tuple[float, float] = (0.1, math.nan)
) -> tuple[TransportBatch, StepReport, list[TransportBatch]]:
    """The global batch, rank 0's recorded report (`rank_reports` filled as gather_step does)
    and each rank's batch of a 2-rank step."""
    parts = [rank_batch(step, m, offset=1000 * r) for r, m in enumerate(RANK_MICROS)]
    ranks = [
        RankReport(
            rank=r,
            valid_tokens=b.expected_valid_tokens(),
            expected_valid_tokens=b.expected_valid_tokens(),
            local_loss=loss,
            num_micros=b.num_micros,
            num_samples=b.num_samples,
            phase_seconds={"grad": 0.01 * (r + 1)},
        )
        for r, (b, loss) in enumerate(zip(parts, local_losses))
    ]
    total = sum(b.expected_valid_tokens() for b in parts)
    report = make_report(
        step=step,
        valid_tokens=parts[0].expected_valid_tokens(),
        expected_valid_tokens=parts[0].expected_valid_tokens(),
        num_micros=parts[0].num_micros,
        num_samples=parts[0].num_samples,
        micro_order=list(range(sum(RANK_MICROS))),
        world_size=2,
        global_valid_tokens=total,
        rank_expected_valid_tokens=[b.expected_valid_tokens() for b in parts],
        local_loss=local_losses[0],
        rank_reports=ranks,
    )
    return TransportBatch.concat(parts), report, parts


def recorder_for(run_dir: Path, store_url: str = "") -> FlightRecorder:
    recorder = FlightRecorder(run_dir, ForensicsConfig(store_url=store_url))
    stand_in_run_json(run_dir, "r1")
    recorder.start_run("r1", {"engine": {}, "guards": {}}, {}, "cpu")
    return recorder


def checkpoint(recorder: FlightRecorder, run_dir: Path, step: int) -> None:
    """A checkpoint directory on disk (retention keeps only those) and its row."""
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    recorder.note_checkpoint(step, path)


def stored_batch(store: Store, session: object, digest: str) -> TransportBatch:
    from grpod.forensics import BlobStore

    tensors, metadata = BlobStore(store.run_dir).read(digest, session.get(Blob, digest).data)
    return TransportBatch.from_tensors(tensors, metadata)


def same_batch(a: TransportBatch, b: TransportBatch) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


def test_each_rank_is_a_row_naming_its_slice_of_the_one_blob(
    tmp_path: Path, store_url: str
) -> None:
    recorder = recorder_for(tmp_path, store_url)
    recorder.record(decided(tiny_batch(0), tiny_report(0), PASS, "applied"))  # one process: no rows
    batch, report, parts = distributed_step(1)
    recorder.record(decided(batch, report, PASS, "applied"))
    recorder.close()
    assert recorder.commits_total == 1  # the rank rows committed with their step

    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        one, step = (store.latest_step(session, s) for s in (0, 1))
        assert store.step_ranks(session, one) == []
        rows = session.scalars(select(StepRank).order_by(StepRank.rank)).all()
        assert [
            (r.step_id, r.run_id, r.step, r.rank, r.batch_digest, r.valid_tokens) for r in rows
        ] == [(step.id, "r1", 1, rank, step.batch_digest, 8 * (1 + rank)) for rank in (0, 1)]
        assert [json.loads(r.report_json) for r in rows] == to_json(report.rank_reports)
        records = store.step_ranks(session, step)
        assert [(r.first_micro, r.num_micros, r.first_sample, r.num_samples) for r in records] == [
            (0, 1, 0, 2),
            (1, 2, 2, 4),
        ]
        assert records[0].local_loss == 0.1 and math.isnan(records[1].local_loss)  # via JSON
        assert records[1].report["phase_seconds"] == {"grad": 0.02}
        blob = stored_batch(store, session, step.batch_digest)
    store.close()
    assert same_batch(blob, batch)
    for record, part in zip(records, parts):
        micros = slice(record.first_micro, record.first_micro + record.num_micros)
        samples = slice(record.first_sample, record.first_sample + record.num_samples)
        assert same_batch(blob.part(record.rank), part)
        assert blob.input_ids[micros].equal(part.input_ids)
        assert blob.rewards[samples].equal(part.rewards)


def test_a_rerun_step_records_rank_rows_of_its_own(tmp_path: Path, store_url: str) -> None:
    recorder = recorder_for(tmp_path, store_url)
    batch, report, _ = distributed_step(0, (0.1, 0.2))
    recorder.record(decided(batch, report, FLUSH, "flushed"))
    recorder.close()
    recorder = recorder_for(tmp_path, store_url)  # resumed: step 0 again
    batch, report, _ = distributed_step(0, (0.3, 0.4))
    recorder.record(decided(batch, report, PASS, "applied"), rerun=True)
    recorder.close()

    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        first, rerun = session.scalars(select(Step).order_by(Step.id)).all()
        assert rerun.rerun and store.latest_step(session, 0).id == rerun.id
        assert [r.local_loss for r in store.step_ranks(session, first)] == [0.1, 0.2]
        assert [r.local_loss for r in store.step_ranks(session, rerun)] == [0.3, 0.4]
        by_step = select(StepRank.step_id, StepRank.rank).where(
            StepRank.run_id == "r1", StepRank.step == 0
        )
        keys = sorted(session.execute(by_step).all())
        assert keys == [(first.id, 0), (first.id, 1), (rerun.id, 0), (rerun.id, 1)]
    store.close()
    assert fsck(tmp_path, store_url).ok


def record_an_incident_on_a_distributed_step(run_dir: Path) -> list[TransportBatch]:
    """Checkpoints 0, 3 and 6; step 3 is distributed and flushed (incident 1)."""
    recorder = recorder_for(run_dir)
    parts: list[TransportBatch] = []
    for step in range(7):
        if step % 3 == 0:
            checkpoint(recorder, run_dir, step)
        if step == 3:
            batch, report, parts = distributed_step(step)
            recorder.record(decided(batch, report, FLUSH, "flushed"))
        else:
            recorder.record(decided(tiny_batch(step), tiny_report(step), PASS, "applied"))
    recorder.close()
    assert recorder.incidents_total == 1
    return parts


def test_an_incident_pins_every_ranks_batch_and_shows_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    parts = record_an_incident_on_a_distributed_step(tmp_path)
    done = gc(tmp_path, budget_bytes=0)
    assert done.blobs_deleted == 5 and done.checkpoints_deleted == [0]  # steps 0-2, 4, 5
    store = Store(tmp_path, create=False)
    with store.session() as session:
        kept = set(session.scalars(select(Blob.sha256)))
        digests = set(session.scalars(select(StepRank.batch_digest)))
        assert len(digests) == 1 and digests <= kept
    store.close()
    detail, _, batch = incident_batch(tmp_path, 1)
    assert all(same_batch(batch.part(r), part) for r, part in enumerate(parts))
    assert [
        (r["step"], r["rank"], r["valid_tokens"], r["num_micros"]) for r in detail["ranks"]
    ] == [
        (3, 0, 8, 1),
        (3, 1, 16, 2),
    ]
    assert detail["ranks"][1]["local_loss"] == "nan"
    report = fsck(tmp_path)
    # blobs, rank rows and pins are whole; the checkpoints are this test's stand-ins (a
    # 64-byte model file, no state.json), which fsck checks as resume would
    assert report.blobs_checked == 2 and report.problems
    assert all(p.startswith("checkpoint step ") or p == report.resume for p in report.problems)

    assert main(["incidents", "show", "1", "--run-dir", str(tmp_path)]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert [line for line in lines if " rank " in line] == [
        "step 3 rank 0 valid_tokens 8 expected 8 local_loss 0.1 micros 1 from 0",
        "step 3 rank 1 valid_tokens 16 expected 16 local_loss nan micros 2 from 1",
    ]
    assert main(["incidents", "show", "1", "--run-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == detail["ranks"]


def _set_rank(run_dir: Path, rank: int, **values: int) -> None:
    """Overwrite columns of step 0's row of `rank`."""
    store = Store(run_dir, create=False)
    with store.session() as session:
        row = (StepRank.step == 0) & (StepRank.rank == rank)
        session.execute(update(StepRank).where(row).values(**values))
    store.close()


def test_fsck_finds_rank_rows_that_do_not_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recorder = recorder_for(tmp_path)
    batch, report, _ = distributed_step(0)
    recorder.record(decided(batch, report, PASS, "applied"))
    batch, report, _ = distributed_step(1)  # skipped: no compute, no global count
    ranks = [replace(r, valid_tokens=0, local_loss=None) for r in report.rank_reports]
    skipped = replace(report, valid_tokens=0, global_valid_tokens=None, rank_reports=ranks)
    recorder.record(decided(batch, skipped, FLUSH, "skipped"))
    recorder.close()
    assert fsck(tmp_path).ok
    where = "step 0 (record 1)"

    _set_rank(tmp_path, 1, valid_tokens=17)
    assert fsck(tmp_path).problems == [
        f"{where}: rank rows sum to 25 valid tokens, global_valid_tokens 24"
    ]
    assert main(["fsck", "--run-dir", str(tmp_path)]) == 1
    assert "problem: step 0 (record 1): rank rows sum to 25" in capsys.readouterr().out
    _set_rank(tmp_path, 1, valid_tokens=16, first_micro=2)
    assert fsck(tmp_path).problems == [
        f"{where}: rank micro ranges [0, 1), [2, 4) do not tile the blob's 3 micros"
    ]
    _set_rank(tmp_path, 1, first_micro=1, num_samples=3)
    assert fsck(tmp_path).problems == [
        f"{where}: rank sample ranges [0, 2), [2, 5) do not tile the blob's 6 samples"
    ]
    _set_rank(tmp_path, 1, num_samples=4)
    assert fsck(tmp_path).ok
    store = Store(tmp_path, create=False)
    with store.session() as session:
        session.execute(delete(StepRank).where(StepRank.step == 0, StepRank.rank == 1))
    store.close()
    problems = fsck(tmp_path).problems
    assert problems[0] == f"{where}: rank rows [0], world size 2" and len(problems) == 4


def test_a_0004_store_upgrades_and_reads_its_ranks_from_the_report(
    tmp_path: Path, store_url: str, capsys: pytest.CaptureFixture
) -> None:
    recorder = recorder_for(tmp_path, store_url)
    batch, report, _ = distributed_step(0, (0.1, 0.2))  # finite: compared with ==
    recorder.record(decided(batch, report, PASS, "applied"))
    recorder.close()
    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        recorded = store.step_ranks(session, store.latest_step(session, 0))
    _migrate(store, "downgrade", "0004")  # the store as the grpod before rank rows wrote it
    with store.engine.connect() as conn:
        assert not inspect(conn).has_table("step_ranks")
    store.close()
    with pytest.raises(ForensicsError, match="older than 0008_incident_samples"):
        FlightRecorder(tmp_path, ForensicsConfig(store_url=store_url), upgrade=False)

    url = ["--store-url", store_url] if store_url else []
    assert main(["db", "upgrade", "--run-dir", str(tmp_path), *url]) == 0
    assert "revision 0008_incident_samples" in capsys.readouterr().out
    recorder = recorder_for(tmp_path, store_url)  # a new step records its rows
    batch, report, _ = distributed_step(1, (0.5, 0.5))
    recorder.record(decided(batch, report, PASS, "applied"))
    recorder.close()
    store = Store(tmp_path, store_url, create=False)
    with store.session() as session:
        assert session.scalars(select(StepRank.step).distinct()).all() == [1]
        old = store.step_ranks(session, store.latest_step(session, 0))  # from its report
        assert [asdict(r) for r in old] == [asdict(r) for r in recorded]
        assert [r.local_loss for r in store.step_ranks(session, store.latest_step(session, 1))] == [
            0.5,
            0.5,
        ]
    with pytest.raises(Exception, match="stored inline; nothing changed"):
        _migrate(store, "downgrade", "0001")
    with store.engine.connect() as conn:  # the refused downgrade rolled back whole
        assert inspect(conn).has_table("step_ranks")
        assert conn.scalar(select(func.count()).select_from(StepRank)) == 2
    assert store.revision() == "0008_incident_samples"
    store.close()
    assert fsck(tmp_path, store_url).ok


def test_replay_of_one_rank_compares_its_rank_row(tmp_path: Path) -> None:
    """A 2-rank step whose ranks ran the same batch: rank 1's part replays alone, against
    its row's numbers (then, without rows, its report's)."""
    torch.set_num_threads(1)
    config = EngineConfig.model_validate(TINY)
    engine = Engine(config)
    recorder = FlightRecorder(tmp_path)
    versions = {"torch": importlib.metadata.version("torch")}
    recorder.start_run(
        "r1", {"engine": config.model_dump(mode="json"), "guards": {}}, versions, "cpu"
    )
    path = tmp_path / "checkpoints" / "step-00000000"
    engine.save_checkpoint(path, extra={"guards": {}})
    recorder.note_checkpoint(0, path)
    batch = engine.rollout()
    total = 2 * batch.expected_valid_tokens()
    mine = engine.accumulate(batch, global_valid_tokens=total)  # one rank's numbers
    engine.flush()
    ranks = [replace(RankReport.of(mine, {}), rank=r) for r in (0, 1)]
    order = mine.micro_order + [batch.num_micros + m for m in mine.micro_order]
    report = replace(
        mine, world_size=2, global_valid_tokens=total, micro_order=order, rank_reports=ranks
    )
    recorder.record(decided(TransportBatch.concat([batch, batch]), report, FLUSH, "flushed"))
    recorder.close()

    result = replay(tmp_path, step=0, rank=1, trace=True)
    assert result.reproduced and result.trace and all(row["equal"] for row in result.trace)
    assert result.recorded == {"valid_tokens": mine.valid_tokens, "local_loss": mine.local_loss}
    with pytest.raises(ForensicsError, match="step 0: no rank 2"):
        replay(tmp_path, step=0, rank=2)
    store = Store(tmp_path, create=False)
    with store.session() as session:  # one ulp off in rank 1's row only
        row = session.scalars(select(StepRank).where(StepRank.rank == 1)).one()
        changed = {**json.loads(row.report_json)}
        changed["local_loss"] = math.nextafter(changed["local_loss"], math.inf)
        row.report_json = json.dumps(changed)
    store.close()
    result = replay(tmp_path, step=0, rank=1)
    assert not result.reproduced and result.field == "local_loss"
    assert replay(tmp_path, step=0, rank=0).reproduced
    store = Store(tmp_path, create=False)
    with store.engine.begin() as conn:  # a store before rank rows: its report's numbers
        conn.execute(text("DELETE FROM step_ranks"))
    store.close()
    assert replay(tmp_path, step=0, rank=1).reproduced


def _record_one_step(
    run_dir: Path, checkpoint: Path, config: EngineConfig, batch: TransportBatch, report: StepReport
) -> None:
    """A run of one flushed step, `report` as recorded, from (a copy of) `checkpoint`."""
    recorder = FlightRecorder(run_dir)
    run_config = {"engine": config.model_dump(mode="json"), "guards": {}}
    recorder.start_run("r1", run_config, {"torch": importlib.metadata.version("torch")}, "cpu")
    path = run_dir / "checkpoints" / "step-00000000"
    shutil.copytree(checkpoint, path)
    recorder.note_checkpoint(0, path)
    recorder.record(decided(batch, report, FLUSH, "flushed"))
    recorder.close()


def test_a_replay_in_another_topology_is_compared_within_a_stated_tolerance(
    tmp_path: Path,
) -> None:
    """A 2-rank step replayed in one process: its sums run in another order, so its floats
    are compared within 1e-6 relative (and the verdict says so), its counts exactly; beyond
    that it diverged, naming the field; in the recorded topology bit-exact stays the verdict."""
    torch.set_num_threads(1)
    config = EngineConfig.model_validate(TINY)
    engine = Engine(config)
    checkpoint = tmp_path / "step-0"
    engine.save_checkpoint(checkpoint, extra={"guards": {}})
    part = engine.rollout()
    batch = TransportBatch.concat([part, part])  # two ranks that ran the same batch
    one = engine.accumulate(batch)  # the step in one process
    engine.flush()
    ranks = [
        {
            "rank": r,
            "valid_tokens": one.valid_tokens // 2,
            "expected_valid_tokens": one.valid_tokens // 2,
            "local_loss": 0.0,
            "num_micros": part.num_micros,
            "num_samples": part.num_samples,
            "phase_seconds": {},
            "chunk_trace": [],
        }
        for r in (0, 1)
    ]
    on_2_ranks = replace(
        one, world_size=2, global_valid_tokens=one.valid_tokens, rank_reports=ranks
    )

    def replayed(name: str, report: StepReport, **kwargs: object):
        _record_one_step(tmp_path / name, checkpoint, config, batch, report)
        return replay(tmp_path / name, step=0, **kwargs)

    # 6e-8 relative on the grad norm: what another reduction order did (issue 26)
    near = replayed("near", replace(on_2_ranks, grad_norm=one.grad_norm * (1 + 6e-8)))
    assert near.reproduced == (
        "within 1e-6 (recorded on 2 ranks, replayed in 1 process: reduction order differs)"
    )
    assert near.classification == "persistent" and near.field is None  # a flushed step
    far = replayed("far", replace(on_2_ranks, grad_norm=one.grad_norm * (1 + 1e-3)))
    assert far.reproduced is False and far.field == "grad_norm"
    assert far.classification == "transient"
    assert far.note.startswith("diverged in grad_norm: beyond 1e-6 (recorded on 2 ranks")
    counts = replayed("counts", replace(on_2_ranks, global_valid_tokens=one.valid_tokens + 1))
    assert counts.reproduced is False and counts.field == "valid_tokens"  # counts: exactly
    # the same topology (one process) as recorded: bit-exact, one ulp is a divergence
    ulp = replayed("ulp", replace(one, grad_norm=math.nextafter(one.grad_norm, math.inf)))
    assert ulp.reproduced is False and ulp.field == "grad_norm"
    assert replay(tmp_path / "near", step=0, rank=1).replayed["valid_tokens"] == (
        one.valid_tokens // 2
    )
    valid = r"step 0: no rank 5: it ran on 2 ranks \(valid: --rank 0, 1\)"
    with pytest.raises(ForensicsError, match=valid):
        replay(tmp_path / "near", step=0, rank=5)
    with pytest.raises(ForensicsError, match="step 0: --rank 0: the step ran in one process"):
        replay(tmp_path / "ulp", step=0, rank=0)
