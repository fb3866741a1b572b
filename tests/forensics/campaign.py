"""A real campaign through the public pieces: Engine + FlightRecorder + checkpoints.

The daemon drives the recorder through the same calls (start_run, note_checkpoint, record,
close); the verdict here is a stand-in for the guards' (a contract verdict dict).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpod.engine import Engine, EngineConfig, StepReport
from grpod.forensics import FlightRecorder, ForensicsConfig
from tests.daemon.helpers import TINY_ENGINE
from tests.forensics.test_store import decided

TINY = {**TINY_ENGINE, "task": "arith", "sequence_chunks": 2}  # the daemon tests' tiny engine


@dataclass
class Campaign:
    run_dir: Path
    config: EngineConfig
    reports: dict[int, StepReport] = field(default_factory=dict)
    outcomes: dict[int, str] = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)
    incidents_total: int = 0
    blocked_total: int = 0


def verdict_for(report: StepReport) -> dict[str, Any]:
    """FLUSH a step whose loss or grad norm is not finite, WARN on a token-count mismatch."""
    findings = []
    if not (math.isfinite(report.loss) and math.isfinite(report.grad_norm)):
        findings.append(
            {
                "guard": "nonfinite",
                "action": "FLUSH",
                "message": f"step {report.step}: loss {report.loss}, grad norm {report.grad_norm}",
                "evidence": {"grad_norm": report.grad_norm},
            }
        )
    if report.valid_tokens != report.expected_valid_tokens:
        findings.append(
            {
                "guard": "accounting",
                "action": "WARN",
                "message": "valid tokens differ from the loss mask",
                "evidence": {"valid_tokens": float(report.valid_tokens)},
            }
        )
    order = ["PASS", "WARN", "FLUSH", "HALT"]
    action = max((f["action"] for f in findings), key=order.index, default="PASS")
    return {"action": action, "findings": findings}


def stand_in_run_json(run_dir: Path, run_id: str) -> None:
    """The run.json `grpod run` writes beside its store (the CLI's readers refuse a run dir
    without one): a run id, and no model or task files to digest."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "inputs": {}}) + "\n")


def run_campaign(
    run_dir: Path,
    steps: int,
    *,
    checkpoint_every: int = 5,
    forensics: ForensicsConfig | None = None,
    skip_steps: tuple[int, ...] = (),
    **engine_overrides: Any,
) -> Campaign:
    """Run `steps` steps, checkpointing at step 0 and every `checkpoint_every`, recording all."""
    torch.set_num_threads(1)
    config = EngineConfig.model_validate({**TINY, **engine_overrides})
    forensics = forensics or ForensicsConfig()
    engine = Engine(config)
    recorder = FlightRecorder(run_dir, forensics)
    stand_in_run_json(run_dir, f"run-{run_dir.name}")
    recorder.start_run(
        f"run-{run_dir.name}",
        {
            "engine": config.model_dump(mode="json"),
            "guards": {},
            "forensics": forensics.model_dump(mode="json"),
            "daemon": {},
        },
        {"torch": importlib.metadata.version("torch")},
        "cpu",
    )
    campaign = Campaign(run_dir, config)
    try:
        while engine.step < steps:
            if engine.step % checkpoint_every == 0:
                path = run_dir / "checkpoints" / f"step-{engine.step:08d}"
                engine.save_checkpoint(path, extra={"guards": {}})
                recorder.note_checkpoint(engine.step, path)
                campaign.checkpoints.append(engine.step)
            batch = engine.rollout()
            if batch.step in skip_steps:
                report, verdict, outcome = (
                    engine.skip(batch),
                    {"action": "FLUSH", "findings": []},
                    "skipped",
                )
            else:
                if batch.num_micros > 1:
                    batch = batch.reorder(list(reversed(range(batch.num_micros))))
                report = engine.accumulate(batch)
                verdict = verdict_for(report)
                if verdict["action"] in ("FLUSH", "HALT"):
                    outcome = "flushed"
                    engine.flush()
                else:
                    outcome = "applied"
                    engine.apply()
            recorder.record(decided(batch, report, verdict, outcome, engine.context))
            campaign.reports[report.step] = report
            campaign.outcomes[report.step] = outcome
    finally:
        recorder.close()
    campaign.incidents_total = recorder.incidents_total
    campaign.blocked_total = recorder.blocked_total
    return campaign
