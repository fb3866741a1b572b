"""Replay: restore the checkpoint, re-apply recorded steps as decided, compare bit-exactly."""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, update

from grpod.engine import TransportBatch
from grpod.forensics import BlobStore, ForensicsError, Store, list_incidents, replay
from grpod.forensics.models import Blob, Step
from grpod.forensics.step_replay import as_run, bit_equal
from tests.forensics.campaign import Campaign, run_campaign
from tests.forensics.conftest import FAULT_STEP, damage_blob

GRPOD = str(Path(sys.executable).with_name("grpod"))


def test_fault_opens_an_incident_whose_replay_reproduces(recorded: Campaign) -> None:
    assert recorded.outcomes[FAULT_STEP] == "flushed" and recorded.incidents_total == 1
    (incident,) = list_incidents(recorded.run_dir)
    assert (incident["step"], incident["action"], incident["checkpoint_step"]) == (7, "FLUSH", 5)
    result = replay(recorded.run_dir, incident_id=incident["id"], trace=True)
    assert result.reproduced and result.classification == "persistent"
    assert (result.step, result.checkpoint_step, result.steps_replayed) == (7, 5, 3)
    assert result.recorded["loss"] == result.replayed["loss"] == "nan"
    assert bit_equal(float(result.replayed["grad_norm"]), recorded.reports[FAULT_STEP].grad_norm)
    assert result.trace and all(row["equal"] for row in result.trace)
    report = recorded.reports[FAULT_STEP]
    assert [(r["micro"], r["chunk"]) for r in result.trace] == [
        (c.micro, c.chunk) for c in report.chunk_trace
    ]


def test_healthy_step_reproduces(recorded: Campaign) -> None:
    result = replay(recorded.run_dir, step=11)
    assert result.reproduced and result.classification == "healthy"
    assert result.checkpoint_step == 10 and result.diverged_at is None and not result.note
    report = recorded.reports[11]
    assert result.replayed == {
        "valid_tokens": report.valid_tokens,
        "loss": report.loss,
        "grad_norm": report.grad_norm,
    }


def test_ten_steps_past_a_checkpoint_are_bit_exact(tmp_path: Path) -> None:
    run = run_campaign(tmp_path / "run", 11, checkpoint_every=100, skip_steps=(4,))
    assert run.checkpoints == [0] and run.outcomes[4] == "skipped"
    result = replay(run.run_dir, step=10)
    assert result.reproduced and result.steps_replayed == 11 and not result.note
    for name in ("valid_tokens", "loss", "grad_norm"):
        assert bit_equal(result.replayed[name], getattr(run.reports[10], name))
    skipped = replay(run.run_dir, step=4)  # computed now, compared up to the step before
    assert skipped.reproduced and skipped.note and skipped.replayed["valid_tokens"] > 0
    assert skipped.recorded["valid_tokens"] == 0
    # A record that differs by one ulp at step 6 is found, named, and the target is transient.
    store = Store(run.run_dir)
    with store.session() as session:
        row = session.scalars(select(Step).where(Step.step == 6)).one()
        report = json.loads(row.report_json)
        report["grad_norm"] = math.nextafter(report["grad_norm"], math.inf)
        session.execute(
            update(Step).where(Step.id == row.id).values(report_json=json.dumps(report))
        )
    store.close()
    result = replay(run.run_dir, step=10)
    assert not result.reproduced and result.classification == "transient"
    assert (result.diverged_at, result.field) == (6, "grad_norm")


def _digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_flipped_blob_byte_is_refused_and_nothing_is_modified(run_copy: Path) -> None:
    store = Store(run_copy)
    with store.session() as session:
        digest = session.scalars(select(Step.batch_digest).where(Step.step == 6)).one()
    store.close()
    damage_blob(run_copy, digest, offset=-3)
    before = _digest_of(run_copy / "grpod.sqlite")
    with pytest.raises(ForensicsError, match=f"blob {digest}: digest mismatch"):
        replay(run_copy, incident_id=1)
    assert _digest_of(run_copy / "grpod.sqlite") == before


def test_bad_input_is_one_clear_error(run_copy: Path) -> None:
    with pytest.raises(ForensicsError, match="step 99: not recorded"):
        replay(run_copy, step=99)
    with pytest.raises(ForensicsError, match="incident 42: no such incident"):
        replay(run_copy, incident_id=42)
    with pytest.raises(ForensicsError, match="exactly one"):
        replay(run_copy)
    shutil.rmtree(run_copy / "checkpoints" / "step-00000005")
    refused = r"incident 1 \(step 7\): cannot be rebuilt: checkpoint step 5: missing directory"
    with pytest.raises(ForensicsError, match=refused):
        replay(run_copy, incident_id=1)
    shutil.rmtree(run_copy / "checkpoints" / "step-00000000")
    with pytest.raises(ForensicsError, match="step 3: no checkpoint at or before it"):
        replay(run_copy, step=3)


def test_as_run_accepts_the_batch_as_rolled_out_or_as_run(recorded: Campaign) -> None:
    store = Store(recorded.run_dir, create=False)
    with store.session() as session:
        row = session.scalars(select(Step).where(Step.step == 3)).one()
        blob = session.get(Blob, row.batch_digest)
        tensors, metadata = BlobStore(recorded.run_dir).read(row.batch_digest, blob.data)
    store.close()
    as_recorded = TransportBatch.from_tensors(tensors, metadata)
    order = as_recorded.micro_order
    assert order == [1, 0]  # the campaign reorders before running
    original = as_recorded.reorder([1, 0])  # back to the order it was rolled out in
    assert original.micro_order == [0, 1]
    for batch in (as_recorded, original):
        rebuilt = as_run(batch, order)
        assert rebuilt.input_ids.equal(as_recorded.input_ids)


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_cli_replay_json_and_bad_input_exit_codes(recorded: Campaign) -> None:
    run_dir = str(recorded.run_dir)
    out = subprocess.run(
        [GRPOD, "replay", "1", "--run-dir", run_dir, "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"reproduced", "step", "recorded", "replayed", "classification"} <= set(result)
    assert result["reproduced"] is True and result["step"] == FAULT_STEP
    assert "\r" not in out.stderr  # no progress bar without a TTY
    bad = subprocess.run(
        [GRPOD, "replay", "--step", "99", "--run-dir", run_dir], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"grpod replay: error: step 99: not recorded in {recorded.run_dir.resolve()}"
    ]


@pytest.mark.postgres
def test_record_and_replay_through_a_shared_store(tmp_path: Path, pg_store_url: str) -> None:
    from grpod.forensics import ForensicsConfig

    store_url = pg_store_url

    run = run_campaign(
        tmp_path / "run",
        5,
        checkpoint_every=100,
        forensics=ForensicsConfig(store_url=store_url),
        faults={"nan_loss_steps": [3]},
    )
    assert run.incidents_total == 1 and not (run.run_dir / "grpod.sqlite").exists()
    (run.run_dir / "config.toml").write_text(f'[forensics]\nstore_url = "{store_url}"\n')
    result = replay(run.run_dir, incident_id=list_incidents(run.run_dir)[0]["id"])
    assert result.reproduced and result.step == 3 and result.steps_replayed == 4


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_text_replay_draws_a_progress_bar_on_a_tty(
    recorded: Campaign, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from grpod.daemon.cli import main

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["replay", "--step", "12", "--run-dir", str(recorded.run_dir), "--trace"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 12: reproduced (healthy)") and "micro chunk" in out
    assert "\rreplay [" in terminal.getvalue() and "3/3 step 12" in terminal.getvalue()


def test_other_software_is_noted(run_copy: Path) -> None:
    store = Store(run_copy)
    with store.session() as session:  # each step's execution context names the software
        for row in session.scalars(select(Step)).all():
            context = {**json.loads(row.context_json), "torch": "1.0.0"}
            row.context_json = json.dumps(context)
    store.close()
    result = replay(run_copy, step=12)
    (line,) = result.context["notes"]
    assert result.reproduced and line.startswith("context differs: torch recorded '1.0.0'")
    # a store before execution contexts: the run's versions
    from grpod.forensics.models import Run

    store = Store(run_copy)
    with store.session() as session:
        session.execute(update(Run).values(versions_json=json.dumps({"torch": "1.0.0"})))
        session.execute(update(Step).values(context_json=None))
    store.close()
    result = replay(run_copy, step=12)
    assert result.reproduced and "recorded with torch 1.0.0, replayed with" in result.note
