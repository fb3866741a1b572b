"""Every rank's part of a distributed step: its `step_ranks` row, and the record read back.

Under torchrun rank 0 records a step once: the global batch (`TransportBatch.concat` of the
rank batches) as one blob, and a report whose `rank_reports` hold each rank's dict. Each rank
also gets a row (schema 0005) naming its micros and samples of that blob, in rank order, and
its counts. A step recorded before 0005 has no rows: its records are read from the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from grpod.base.jsonsafe import from_json, to_json
from grpod.forensics.models import StepRank


@dataclass(frozen=True)
class RankRecord:
    """One rank's recorded part of a step: blob micros `[first_micro, first_micro +
    num_micros)` and samples likewise (its `TransportBatch.part(rank)`), its numbers."""

    rank: int
    first_micro: int
    num_micros: int
    first_sample: int
    num_samples: int
    valid_tokens: int  # the rank's local count
    expected_valid_tokens: int
    local_loss: float | None  # loss sum / the step's global valid tokens (NaN kept)
    report: dict[str, Any]  # the rank's `rank_reports` dict, JSON-safe

    def to_dict(self) -> dict[str, Any]:
        """The scalars, JSON-safe (the report dict is left out: the step's report holds it)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "report"}
        out["local_loss"] = to_json(self.local_loss)
        return out


def rank_columns(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The `step_ranks` columns of each rank of `report` (`StepReport.to_dict()`), in rank
    order, without the step's keys (step_id, run_id, step, batch_digest); [] for a
    one-process step. The ranges follow each rank's own micro and sample counts."""
    out, micro, sample = [], 0, 0
    if int(report.get("world_size", 1)) <= 1:  # one process, or a replica per rank
        return out
    for rank in sorted(report.get("rank_reports") or [], key=lambda r: r["rank"]):
        out.append(
            dict(
                rank=rank["rank"],
                first_micro=micro,
                num_micros=rank["num_micros"],
                first_sample=sample,
                num_samples=rank["num_samples"],
                valid_tokens=rank["valid_tokens"],
                expected_valid_tokens=rank["expected_valid_tokens"],
                local_loss=from_json(rank["local_loss"]),
                report_json=json.dumps(rank),
            )
        )
        micro += rank["num_micros"]
        sample += rank["num_samples"]
    return out


def rank_records(rows: list[StepRank], report_json: str) -> list[RankRecord]:
    """The records of a step's rank rows, by rank; without rows (a step recorded before
    schema 0005), those of its report's `rank_reports`."""
    columns = [_columns(row) for row in rows] or rank_columns(json.loads(report_json))
    return [_record(c) for c in sorted(columns, key=lambda c: c["rank"])]


def _columns(row: StepRank) -> dict[str, Any]:
    return {c.name: getattr(row, c.name) for c in StepRank.__table__.columns}


def _record(columns: dict[str, Any]) -> RankRecord:
    report = json.loads(columns["report_json"])
    return RankRecord(
        rank=columns["rank"],
        first_micro=columns["first_micro"],
        num_micros=columns["num_micros"],
        first_sample=columns["first_sample"],
        num_samples=columns["num_samples"],
        valid_tokens=columns["valid_tokens"],
        expected_valid_tokens=columns["expected_valid_tokens"],
        # the JSON, not the REAL column: SQLite stores a NaN as NULL
        local_loss=from_json(report["local_loss"]),
        report=report,
    )
