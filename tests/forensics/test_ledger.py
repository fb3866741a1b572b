"""The prompt ledger's rules (forensics/ledger.py): where a prompt is in the data stream, the
fate each step writes, the rows a resume supersedes, and what fsck finds."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from grpod.engine.data.tasks import ArithTask
from grpod.engine.rollout.ahead import AheadStats, Dropped
from grpod.forensics import FlightRecorder, ForensicsConfig, fsck
from grpod.forensics.ledger import LedgerSpec, check_store, coverage_line, step_rows
from grpod.forensics.store import Store
from tests.forensics.campaign import stand_in_run_json
from tests.forensics.test_store import decided, tiny_batch, tiny_report

PASS = {"action": "PASS", "findings": []}
FLUSH = {
    "action": "FLUSH",
    "findings": [
        {"guard": "spike", "action": "FLUSH", "message": "m", "evidence": {}, "kind": "loss"},
        {"guard": "accounting", "action": "WARN", "message": "m", "evidence": {}},
    ],
}
# 2 prompts a step, 6 prompts an epoch: an epoch is 3 steps
SPEC = LedgerSpec(prompts_per_step=2, epochs=1, epoch_size=6, seed=5)
CONFIG = {"engine": {"prompts_per_step": 2, "epochs": 1, "seed": 5}, "guards": {}}


def two_prompt_batch(step: int, epochs: int = 1) -> Any:
    """Step `step`'s batch: 2 samples, one of each of 2 prompts (groups 0 and 1)."""
    batch = tiny_batch(step)
    groups = torch.tensor([0, 1], dtype=torch.int32)
    return dataclasses.replace(batch, sample_group_ids=groups, generation=step // epochs)


def test_a_prompt_id_locates_the_task_row_the_engine_trains() -> None:
    task = ArithTask(count=6)
    for generation in range(7):  # two epochs and a bit
        trained = task.prompts_for_step(generation, 2, 5)
        spec = dataclasses.replace(SPEC)
        rows = [spec.locate(p) for p in spec.prompt_ids(generation)]
        assert [task.prompts[row] for _, row in rows] == trained
        assert {epoch for epoch, _ in rows} == {generation * 2 // 6}
    assert LedgerSpec(4).locate(17) == (0, None)  # a generated task: one endless epoch
    assert list(LedgerSpec(2, epochs=3).prompt_ids(5)) == [2, 3]  # generation 1


def test_step_rows_fates_reasons_ranks_and_stale_drops() -> None:
    batch = two_prompt_batch(4)  # prompts 8 and 9: epoch 1
    report = tiny_report(4).to_dict()
    rows = step_rows(SPEC, batch, report, PASS, "applied", stale_drops=1)
    assert [(r["prompt_id"], r["epoch"], r["fate"], r["rank"]) for r in rows] == [
        (8, 1, "trained", 0),
        (9, 1, "trained", 0),
    ]
    assert all(r["stale_drops"] == 1 and r["reason"] == "" for r in rows)
    assert rows[0]["task_row"] == SPEC.locate(8)[1]
    flushed = step_rows(SPEC, batch, report, FLUSH, "flushed")
    assert {(r["fate"], r["reason"]) for r in flushed} == {("flushed", "spike/loss")}
    assert {r["fate"] for r in step_rows(SPEC, batch, report, FLUSH, "skipped")} == {"skipped"}
    # torchrun: rank 0 records the global batch; each prompt is named with its rank
    ranks = {**report, "world_size": 2, "rank_reports": [_rank(0), _rank(1)]}
    assert [r["rank"] for r in step_rows(SPEC, batch, ranks, PASS, "applied")] == [0, 1]


def _rank(rank: int) -> dict[str, Any]:
    return dict(
        rank=rank,
        num_micros=1,
        num_samples=1,
        valid_tokens=4,
        expected_valid_tokens=4,
        local_loss=0.1,
    )


def record(
    run_dir: Path,
    steps: range,
    *,
    next_step: int | None,
    flushed: tuple[int, ...] = (),
    dropped: tuple[int, ...] = (),
    evals: tuple[int, ...] = (),
    spec: LedgerSpec = SPEC,
) -> None:
    """One run (or a resume of it at `next_step`) recording `steps` with the ledger on."""
    recorder = FlightRecorder(run_dir, ForensicsConfig())
    config = {"engine": {"prompts_per_step": 2, "epochs": spec.epochs, "seed": 5}}
    recorder.start_run("r1", config, {}, "cpu", ledger=spec, next_step=next_step)
    try:
        for step in steps:
            if step in evals:
                recorder.note_eval(
                    dict(step=step, samples=3, temperature=0.0, rewards={"total": 0.5},
                         completion_length_mean=1.0, seconds=0.1)
                )  # fmt: skip
            flush = step in flushed
            result = decided(
                two_prompt_batch(step, spec.epochs),
                tiny_report(step),
                FLUSH if flush else PASS,
                "flushed" if flush else "applied",
            )
            if step in dropped:
                drop = Dropped(step, 0, 2, "stale")
                result = dataclasses.replace(result, ahead=AheadStats(0.0, (drop,)))
            recorder.record(result)
    finally:
        recorder.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    stand_in_run_json(tmp_path / "run", "r1")
    return tmp_path / "run"


def test_a_killed_and_resumed_run_counts_every_prompt_once(run_dir: Path) -> None:
    # steps 0-4 recorded (step 1 flushed, step 2's rollout dropped as too stale), killed;
    # resumed from the checkpoint before step 3: steps 3 and 4 are re-run, then 5
    record(run_dir, range(5), next_step=0, flushed=(1,), dropped=(2,), evals=(0, 3))
    record(run_dir, range(3, 6), next_step=3)  # the eval at 3 is not repeated
    report = fsck(run_dir)
    ledger = report.ledger
    assert report.ok, report.problems
    assert ledger["checked"] and ledger["missing"] == [] and ledger["duplicated"] == []
    assert ledger["last_step"] == 5
    assert ledger["epochs"] == {
        "0": {"size": 6, "prompts": 6, "complete": True, "fates": {"trained": 4, "flushed": 2}},
        "1": {"size": 6, "prompts": 6, "complete": True, "fates": {"trained": 6}},
    }
    # superseded: steps 3 and 4 (4 rows), no eval row (the eval at 3 ran after checkpoint 3)
    assert ledger["superseded_rows"] == 4 and ledger["eval_rows"] == 6
    store = Store(run_dir)
    try:
        assert coverage_line(check_store(store).to_dict()) == (
            "ledger through step 5: epoch 0 6/6 prompts (trained 4, flushed 2); "
            "epoch 1 6/6 prompts (trained 6)"
        )
    finally:
        store.close()


def test_fsck_names_duplicated_and_missing_prompts(run_dir: Path) -> None:
    record(run_dir, range(4), next_step=0)
    record(run_dir, range(2, 3), next_step=None)  # a resume that superseded nothing
    record(run_dir, range(5, 6), next_step=None)  # step 4 never recorded
    report = fsck(run_dir)
    assert not report.ok
    ledger = report.ledger
    assert [(d["prompt_id"], d["steps"]) for d in ledger["duplicated"]] == [
        (4, [2, 2]),
        (5, [2, 2]),
    ]
    assert [(m["prompt_id"], m["step"]) for m in ledger["missing"]] == [(8, 4), (9, 4)]
    lines = [p for p in report.problems if p.startswith("ledger:")]
    row = SPEC.locate(8)[1]
    assert lines == [
        f"ledger: 2 prompts missing: epoch 1 prompt 8 (task row {row}) at step 4, "
        f"epoch 1 prompt 9 (task row {SPEC.locate(9)[1]}) at step 4",
        f"ledger: 2 prompts duplicated: epoch 0 prompt 4 (task row {SPEC.locate(4)[1]}) at "
        f"step 2, 2, epoch 0 prompt 5 (task row {SPEC.locate(5)[1]}) at step 2, 2",
    ]


def test_a_store_without_ledger_rows_is_noted_not_failed(run_dir: Path) -> None:
    recorder = FlightRecorder(run_dir, ForensicsConfig())
    recorder.start_run("r1", CONFIG, {}, "cpu")  # no ledger: e.g. the TRL front end
    recorder.record(decided(two_prompt_batch(0), tiny_report(0), PASS, "applied"))
    recorder.close()
    report = fsck(run_dir)
    assert report.ok and not report.ledger["checked"] and not report.notes
    assert report.ledger["note"].startswith("no prompt recorded in the ledger")


def test_with_epochs_per_generation_each_pass_is_accounted(run_dir: Path) -> None:
    spec = dataclasses.replace(SPEC, epochs=2)  # steps 2g and 2g + 1 train generation g
    record(run_dir, range(6), next_step=0, flushed=(3,), spec=spec)
    ledger = fsck(run_dir).ledger
    assert ledger["missing"] == ledger["duplicated"] == []
    assert ledger["epochs"] == {
        "0": {"size": 6, "prompts": 6, "complete": True, "fates": {"trained": 10, "flushed": 2}}
    }
    record(run_dir, range(7, 8), next_step=None, spec=spec)  # step 6 (pass 0) never recorded
    ledger = fsck(run_dir).ledger
    assert [(m["prompt_id"], m["step"]) for m in ledger["missing"]] == [(6, 6), (7, 6)]
    assert ledger["epochs"]["1"]["prompts"] == 0  # each of its prompts lacks a pass
