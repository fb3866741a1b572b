"""What a start creates before the loop's first step, besides the engine: the rollout
sampler (vLLM, before READY and before the run dir, so what it refuses creates nothing) and
rank 0's run directory with its flight recorder and the attributor of its incidents."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from grpod.daemon.notify import Notifier
from grpod.daemon.rundir import Plan, link_latest
from grpod.engine import Engine
from grpod.engine.config import EngineConfig
from grpod.forensics.incident_attribution import AttributionRecord, IncidentAttributor
from grpod.forensics.recorder import FlightRecorder


def start_sampler(engine: Engine, config: EngineConfig, notifier: Notifier, log: Any) -> None:
    """vLLM up: colocated, or grpod's own server (or the named one answering)."""
    notifier.extend_timeout(config.vllm_server_start_timeout_seconds)
    notifier.status("starting vLLM")
    started = time.perf_counter()
    engine.start_sampler()
    client, process = (getattr(engine.vllm, k, None) for k in ("client", "process"))
    log.info(
        "rollout server" if client is not None else "vllm started",
        url=client.url if client is not None else None,
        pid=process.pid if process is not None else None,
        started=process is not None,
        seconds=round(time.perf_counter() - started, 3),
    )


def open_run_dir(plan: Plan, log: Any) -> FlightRecorder:
    """Rank 0 (under torchrun it owns the run dir and the store): create the run dir (and
    the `latest` link) or clean a resumed one of half-written checkpoints, and open its
    flight recorder."""
    if not plan.resume:
        plan.run_dir.create(plan.run_id, plan.config)
        if plan.link_latest is not None:
            link_latest(plan.link_latest, plan.run_dir.path)
    else:
        for name in plan.run_dir.remove_stale_temporaries():
            log.warning("removed a half-written checkpoint", path=name)
    recorder = FlightRecorder(plan.run_dir.path, plan.config.forensics)
    recorder.store.lock_run_dir()  # PostgreSQL: one writer per run dir across hosts
    return recorder


def attribute_incidents(
    plan: Plan,
    recorder: FlightRecorder,
    log: Any,
    observe: Callable[[AttributionRecord], None] | None = None,
    run_device: str = "cpu",
) -> IncidentAttributor:
    """Rank 0: every incident the recorder opens is attributed to its samples off the
    training path (forensics/incident_attribution.py); each stored result is logged
    (`incident attributed`) and handed to `observe` (the metrics). `run_device`: the
    engine's device type ("cpu", "cuda"), which sets the attribution's default pace."""
    forensics = plan.config.forensics

    def done(record: AttributionRecord) -> None:
        log.info("incident attributed", **record.log_fields())
        if observe is not None:
            observe(record)

    attributor = IncidentAttributor(
        plan.run_dir.path,
        forensics.attribution,
        store_url=forensics.store_url,
        busy_timeout_ms=forensics.busy_timeout_ms,
        on_done=done,
        run_device=run_device,
    )
    recorder.on_incident = attributor.submit
    return attributor
