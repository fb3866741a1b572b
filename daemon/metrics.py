"""Prometheus metrics: a `Metrics` object on a registry given to it (names in the contracts).

Every value a step publishes comes from the same `StepReport` and `Verdict` the flight
recorder stores, so a scrape matches the store's last step.

Under torchrun every rank writes prometheus_client's multiprocess files: `grpod run` points
`PROMETHEUS_MULTIPROC_DIR` at `<run dir>/prometheus/node-<GROUP_RANK>` before
prometheus_client is imported (`distributed.use_multiprocess_metrics`); the node's local
rank 0 empties it at start (`prepare_multiproc_dir`) before any rank creates a metric, and
serves the node's files on its one endpoint (`serving_registry`). Rank 0 alone publishes
`Metrics` (the step's global numbers: a counter written by every rank would be summed N
times); every rank publishes its own `RankMetrics`, labelled by `rank`, and
`grpod_rank_up{rank}` turns 0 once that rank's process is gone (its other series keep their
last values).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import Metric

from grpod.daemon.campaign_metrics import CampaignMetrics
from grpod.daemon.metric_families import FAMILIES, REPORT_GAUGES, STEP_FAMILIES, Family

if TYPE_CHECKING:  # engine.step imports the Engine (torch): a type here, not an import
    from grpod.engine.grpo.step import StepResult


class _Labelled:
    """Metric children looked up once per label set (labels() validates and locks per call)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, the same child every time."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


class Metrics(_Labelled):
    """The daemon's metrics, registered on `registry` (the `grpod_` names of the contracts):
    one attribute per `Family` of STEP_FAMILIES and FAMILIES (`self.halted`, ...), and
    `report_gauges` {StepReport field: gauge} from REPORT_GAUGES."""

    def __init__(self, registry: CollectorRegistry, versions: dict[str, str] | None = None):
        super().__init__()
        for family in STEP_FAMILIES:
            setattr(self, family.attr, family.make(registry))
        self.report_gauges = {
            field: Family(field, Gauge, name, doc).make(registry)
            for name, (field, doc) in REPORT_GAUGES.items()
        }
        for family in FAMILIES:
            setattr(self, family.attr, family.make(registry))
        if versions:
            self.build_info.labels(
                versions.get("grpod", ""),
                versions.get("torch", ""),
                versions.get("transformers", ""),
            ).set(1)
        self.halted.set(0)
        self._seen = {"incidents": 0, "incident_steps": 0, "blocked": 0}
        self.campaign = CampaignMetrics(registry)  # audit rewards, degeneration, reward_hacking

    def observe_step(
        self,
        result: StepResult,
        gradnorm_vtc_correlation: float | None = None,
        now: float | None = None,
    ) -> None:
        """Publish one finished step: its report, verdict, outcome and phase seconds."""
        report, verdict, outcome = result.report, result.verdict, result.outcome
        phase_seconds = result.phase_seconds
        for field, g in self.report_gauges.items():
            g.set(_number(getattr(report, field)))
        self._child(self.clip_fraction, "low").set(_number(report.clip_fraction_low))
        self._child(self.clip_fraction, "high").set(_number(report.clip_fraction_high))
        self.correlation.set(_number(gradnorm_vtc_correlation))
        self._observe_kv_cache(getattr(report, "kv_cache", None))
        for name, stats in report.reward_functions.items():
            self._child(self.reward_function_mean, name).set(_number(stats["mean"]))
            self._child(self.reward_function_std, name).set(_number(stats["std"]))
        total = report.global_valid_tokens
        self.global_valid_tokens.set(_number(report.valid_tokens if total is None else total))
        self._child(self.steps_total, outcome).inc()
        for finding in verdict.findings:
            self.findings_total.labels(finding.guard, _action_name(finding.action)).inc()
        self.verdict_action.set(int(verdict.action))
        for phase, seconds in phase_seconds.items():
            self._child(self.phase_seconds, phase).observe(seconds)
        synced = phase_seconds.get("sync", 0.0) + phase_seconds.get("sync_check", 0.0)
        if synced > 0.0:
            self.weight_sync_seconds.observe(synced)
        if report.weight_version is not None:
            self.rollout_staleness.observe(report.staleness or 0)
        if result.ahead is not None:
            self.rollout_overlap_seconds_total.inc(result.ahead.overlap_seconds)
            for dropped in result.ahead.dropped:
                self._child(self.rollout_dropped_total, dropped.reason).inc()
        if not report.skipped_compute:
            self.completions_total.inc(report.num_samples)
            self.completion_tokens_total.inc(
                round(report.completion_length_mean * report.num_samples)
            )
        self.campaign.observe(report, verdict)
        self.step.set(report.step)
        self.last_step_timestamp.set(time.time() if now is None else now)

    def _observe_kv_cache(self, kv: Any) -> None:
        """The step's rollout cache (`StepReport.kv_cache`; None: dense, every value NaN)."""
        self.kv_evicted.set(_number(kv and kv.prompt_tokens_evicted))
        self.kv_fill.set(_number(kv and kv.fill))
        policy = kv.policy if kv is not None else "dense"  # fixed for a run: one series
        self._child(self.kv_slots, policy).set(_number(kv and kv.length))
        self._child(self.kv_protected, "sink").set(_number(kv and kv.sink_tokens))
        self._child(self.kv_protected, "grace").set(_number(kv and kv.grace_period))

    def observe_eval(self, step: int, rewards: dict[str, float]) -> None:
        """Publish one held-out evaluation: {reward name or "total": mean}."""
        for name, value in rewards.items():
            self._child(self.eval_reward, name).set(_number(value))
        self.eval_step.set(step)

    def observe_recorder(
        self,
        queue_depth: int,
        blocked_total: int,
        incidents_total: int,
        uncommitted_steps: int = 0,
        *,
        incident_steps_total: int = 0,
        incidents_open: int = 0,
    ) -> None:
        """Mirror the flight recorder's gauges and running totals (totals only go up)."""
        self.recorder_queue_depth.set(queue_depth)
        self.recorder_uncommitted_steps.set(uncommitted_steps)
        self.incidents_open.set(incidents_open)
        for key, total, counter in (
            ("incidents", incidents_total, self.incidents_total),
            ("incident_steps", incident_steps_total, self.incident_steps_total),
            ("blocked", blocked_total, self.recorder_blocked_total),
        ):
            if total > self._seen[key]:
                counter.inc(total - self._seen[key])
                self._seen[key] = total

    def observe_attribution(self, record: Any, now: float | None = None) -> None:
        """An incident's attribution was stored (a forensics `AttributionRecord`): counted by
        status; a computed one replaces the last one's labelled timestamp (the dashboard's
        annotation names its incident, top sample and NaN module)."""
        self._child(self.incident_attributions_total, record.status).inc()
        top = record.top
        if record.status != "done" or top is None:
            return
        module = (record.attribution.get("nonfinite") or {}).get("module", "")
        self.incident_attribution.clear()
        labels = (record.incident_id, record.step, top["index"], module)
        self.incident_attribution.labels(*map(str, labels)).set(time.time() if now is None else now)

    def observe_retention(self, report: Any, over_budget_bytes: int) -> None:
        """One retention pass (a forensics GcReport) and how far its peak went over budget."""
        self.retained_bytes.set(report.kept_bytes)
        self.retention_over_budget_bytes.set(over_budget_bytes)
        self.pruned_bytes_total.inc(report.freed_bytes)
        self._child(self.pruned_total, "checkpoint").inc(len(report.checkpoints_deleted))
        self._child(self.pruned_total, "batch").inc(report.blobs_deleted)


class RankMetrics(_Labelled):
    """One rank's own numbers (`rank`: < world size; one process: rank 0), written by that
    rank: under torchrun into the node's multiprocess files, served by local rank 0."""

    def __init__(self, registry: CollectorRegistry, rank: int) -> None:
        super().__init__()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(
                f"grpod_rank_{name}",
                doc,
                ("rank", *labels),
                registry=registry,
                multiprocess_mode="mostrecent",
            )

        self.rank = str(rank)
        # "all": the series keeps the writer's pid, so the server can tell a dead rank's
        up = Gauge(
            "grpod_rank_up",
            "1 while the rank's process is alive, 0 once it is gone",
            ("rank",),
            registry=registry,
            multiprocess_mode="all",
        )
        up.labels(self.rank).set(1)
        self.step = gauge("step", "Last step the rank finished").labels(self.rank)
        self.valid_tokens = gauge(
            "valid_tokens", "The rank's step-accumulated valid-token count"
        ).labels(self.rank)
        self.expected_valid_tokens = gauge(
            "expected_valid_tokens", "Host-side sum of the rank's loss mask"
        ).labels(self.rank)
        self.last_step_timestamp = gauge(
            "last_step_timestamp_seconds", "Unix time the rank finished its last step"
        ).labels(self.rank)
        self.phase_seconds = gauge(
            "phase_duration_seconds", "The rank's last step, by phase", ("phase",)
        )

    def observe(self, result: StepResult, now: float | None = None) -> None:
        """This rank's own finished step (before any gather): its counts and phase seconds."""
        report = result.report
        self.valid_tokens.set(report.valid_tokens)
        self.expected_valid_tokens.set(report.expected_valid_tokens)
        for phase, seconds in result.phase_seconds.items():
            self._child(self.phase_seconds, self.rank, phase).set(seconds)
        self.step.set(report.step)
        self.last_step_timestamp.set(time.time() if now is None else now)


def prepare_multiproc_dir(path: str | os.PathLike) -> None:
    """Empty (or create) `path`: the files of an earlier start's processes are not this
    run's. Local rank 0 does it before any rank of the node creates a metric; what it cannot
    remove raises (OSError, naming the file), so the job stops with the reason."""
    where = Path(path)
    where.mkdir(parents=True, exist_ok=True)
    for entry in where.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def serving_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """What /metrics serves: `registry`, or the node's multiprocess files."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return registry
    merged = CollectorRegistry(auto_describe=False)
    merged.register(NodeCollector(path))
    return merged


class NodeCollector:
    """Every rank's multiprocess files in `path`, merged; `grpod_rank_up` per rank (no pid
    label), 0 for a rank whose writing process no longer exists on this node."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client import multiprocess

        if not os.path.isdir(self.path):  # before local rank 0 has prepared it
            return
        files = [str(p) for p in Path(self.path).glob("*.db")]
        for metric in multiprocess.MultiProcessCollector.merge(files, accumulate=True):
            if metric.name == "grpod_rank_up":
                metric.samples = _ranks_up(metric.samples)
            yield metric


def _ranks_up(samples: list[Any]) -> list[Any]:
    """One sample per rank: 1 if any process that wrote it is alive, else 0."""
    up: dict[str, Any] = {}
    for sample in samples:
        labels = {k: v for k, v in sample.labels.items() if k != "pid"}
        alive = float(sample.value > 0 and _alive(int(sample.labels.get("pid", "0"))))
        rank = labels.get("rank", "")
        if rank not in up or alive > up[rank].value:
            up[rank] = sample._replace(labels=labels, value=alive)
    return [up[rank] for rank in sorted(up, key=lambda r: (len(r), r))]


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


def _number(value: float | int | None) -> float:
    return math.nan if value is None else float(value)


def _action_name(action: Any) -> str:
    return getattr(action, "name", str(action))
