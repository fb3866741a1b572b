"""Incidents: list, show, and export one (its batch as safetensors + JSON) to hand over.

Listing and showing read the store only: the engine's tensors (torch: seconds to import) are
imported by what reads a batch."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpod.base.fileio import atomic_dir
from grpod.forensics.errors import ForensicsError
from grpod.forensics.incident_attribution import AttributionRecord, load_attribution
from grpod.forensics.models import Blob, Checkpoint, Incident, Step
from grpod.forensics.store import Store

if TYPE_CHECKING:
    from grpod.engine import TransportBatch


def list_incidents(run_dir: str | os.PathLike, store_url: str = "") -> list[dict[str, Any]]:
    """One summary dict per incident (an episode: first..last step, steps with the finding,
    the worst step, open or closed) of the run directory, oldest first."""
    store = Store(run_dir, store_url, create=False)
    try:
        store.check_schema()
        with store.session() as session:
            return [_summary(session, i) for i in store.incidents(session)]
    finally:
        store.close()


def show_incident(
    run_dir: str | os.PathLike, incident_id: int, store_url: str = ""
) -> dict[str, Any]:
    """The incident with its verdict, findings and the step's full report; `ranks`: each
    rank's part of its first and its worst step when distributed, by step and rank;
    `samples`, `nonfinite` and `attribution`: its first step's stored attribution
    (forensics/incident_attribution.py; `samples` [] and a note when there is none)."""
    store = Store(run_dir, store_url, create=False)
    try:
        store.check_schema()
        with store.session() as session:
            incident = store.incident(session, incident_id)
            step = session.get(Step, incident.step_id)
            pinned = dict.fromkeys(filter(None, (incident.step_id, incident.worst_step_id)))
            ranks = [
                {"step": row.step, **record.to_dict()}
                for row in (session.get(Step, step_id) for step_id in pinned)
                for record in store.step_ranks(session, row)
            ]
            return {
                **_summary(session, incident),
                "verdict": json.loads(incident.verdict_json),
                "findings": json.loads(incident.findings_json),
                "batch_digest": step.batch_digest,
                "report": json.loads(step.report_json),
                "ranks": ranks,
                **_attribution(session, incident),
            }
    finally:
        store.close()


def export_incident(
    run_dir: str | os.PathLike,
    incident_id: int,
    out_dir: str | os.PathLike,
    store_url: str = "",
    decode: Callable[[TransportBatch, dict[str, Any]], list[dict[str, Any]]] | None = None,
    by_sample: bool = False,
) -> Path:
    """Write `out_dir/batch.safetensors` and `out_dir/incident.json` (report, findings, config),
    with `decode(batch, run config)` `out_dir/samples.jsonl` (each sample's decoded prompt
    and completion, one JSON object a line), and with `by_sample` `out_dir/attribution.json`
    (the step attributed to its samples, as `grpod replay --by-sample --json` prints it).

    `out_dir` must not exist yet; it appears complete or not at all.
    """
    out = Path(out_dir)
    if out.exists():
        raise ForensicsError(f"export {out}: already exists; choose a new directory")
    detail, config, batch = incident_batch(run_dir, incident_id, store_url)
    attribution = None
    if by_sample:
        from grpod.forensics.attribution import attribute

        attribution = attribute(run_dir, incident_id=incident_id, store_url=store_url).to_dict()
    with atomic_dir(out) as tmp:
        if attribution is not None:
            (tmp / "attribution.json").write_text(json.dumps(attribution, indent=2) + "\n")
        batch.save(tmp / "batch.safetensors")
        (tmp / "incident.json").write_text(
            json.dumps({**detail, "config": config}, indent=2) + "\n"
        )
        if decode is not None:
            lines = [json.dumps(sample, ensure_ascii=False) for sample in decode(batch, config)]
            (tmp / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    return out


def incident_batch(
    run_dir: str | os.PathLike, incident_id: int, store_url: str = ""
) -> tuple[dict[str, Any], dict[str, Any], TransportBatch]:
    """The incident (as `show_incident`), its run's config and its step's batch."""
    from grpod.engine import EngineError, TransportBatch
    from grpod.forensics.blobs import BlobStore

    detail = show_incident(run_dir, incident_id, store_url)
    store = Store(run_dir, store_url, create=False)
    digest = detail["batch_digest"]
    try:
        with store.session() as session:
            config = json.loads(store.run(session, detail["run_id"]).config_json)
            blob = None if digest is None else session.get(Blob, digest)
            data = None if blob is None else blob.data
    finally:
        store.close()
    if digest is None:
        raise ForensicsError(f"incident {incident_id}: its batch was never recorded")
    tensors, metadata = BlobStore(store.run_dir).read(digest, data)
    try:
        batch = TransportBatch.from_tensors(tensors, metadata, source=digest)
    except EngineError as exc:
        raise ForensicsError(str(exc)) from None
    return detail, config, batch


def _attribution(session: Any, incident: Incident) -> dict[str, Any]:
    record = load_attribution(session, incident.id)
    if record is None:
        note = (
            "no attribution stored (the daemon computes one per new incident): "
            f"`grpod incidents show {incident.id} --by-sample` computes it now"
        )
        record = AttributionRecord(incident.id, incident.step, "none", note)
    return record.summary()


def _summary(session: Any, incident: Incident) -> dict[str, Any]:
    step = session.get(Step, incident.step_id)
    checkpoint = (
        None if incident.checkpoint_id is None else session.get(Checkpoint, incident.checkpoint_id)
    )
    findings = json.loads(incident.findings_json)
    last = incident.step if incident.last_step is None else incident.last_step
    return {
        "id": incident.id,
        "run_id": incident.run_id,
        "step": incident.step,
        "action": incident.action,
        "outcome": step.outcome,
        "findings": len(findings),
        "guards": sorted({f.get("guard", "?") for f in findings}),
        "checkpoint_step": None if checkpoint is None else checkpoint.step,
        "created_at": incident.created_at.isoformat(),
        # the episode (schema 0003; an older store's incident is one closed step)
        "guard": incident.guard,
        "kind": incident.kind or "",
        "last_step": last,
        "span_steps": last - incident.step + 1,
        "steps": incident.steps_count,
        "worst_step": incident.step if incident.worst_step is None else incident.worst_step,
        "status": incident.status,
        "closed_at": None if incident.closed_at is None else incident.closed_at.isoformat(),
    }
