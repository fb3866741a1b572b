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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from grpod.daemon.campaign_metrics import CampaignMetrics
from grpod.engine.verdict import Outcome

if TYPE_CHECKING:  # engine.step imports the Engine (torch): a type here, not an import
    from grpod.engine.step import StepResult

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8)  # max_staleness is at most 8 (engine config)
DROP_REASONS = ("stale",)  # engine/ahead.py
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# gauge name -> StepReport field (None in the report -> NaN on the gauge)
REPORT_GAUGES = {
    "loss": ("loss", "Step loss (sum of token losses / step valid tokens)"),
    "reward_mean": ("reward_mean", "Mean reward of the step's completions"),
    "reward_std": ("reward_std", "Population std of the step's rewards"),
    "kl": ("kl", "Mean per-token KL to the reference (NaN when off)"),
    "policy_entropy_nats": (
        "entropy",
        "Mean per-token entropy of the policy on completion tokens (FP32 head)",
    ),
    "valid_tokens": ("valid_tokens", "The engine's step-accumulated valid-token count"),
    "expected_valid_tokens": ("expected_valid_tokens", "Host-side sum of the loss mask"),
    "grad_norm": ("grad_norm", "Global gradient norm before clipping"),
    "clip_coefficient": ("clip_coef", "Gradient clip coefficient min(1, max_norm / norm)"),
    "learning_rate": ("lr", "Learning rate of the step"),
    "zero_std_group_fraction": ("zero_std_group_fraction", "Fraction of equal-reward groups"),
    "sampler_mismatch_p90_nats": ("mismatch_p90", "p90 of |sampler - trainer logprob|"),
    "sampler_mismatch_p99_nats": ("mismatch_p99", "p99 of |sampler - trainer logprob|"),
    "sampler_mismatch_fraction": (
        "mismatch_frac_above_0_1",
        "Fraction of tokens with |sampler - trainer logprob| > 0.1 nats",
    ),
    "step_rollout_staleness_steps": (
        "staleness",
        "Weight versions the step's rollout is behind the policy (0: on-policy; NaN: "
        "max_staleness = 0). The sampler_mismatch gauges of a stale step measure policy drift",
    ),
    "weight_version": (
        "weight_version",
        "The policy's weight version the step's rollout sampled with (its applied updates)",
    ),
    "weight_sync_max_abs_logprob_diff": (
        "weight_sync_max_abs_logprob_diff",
        "Largest |sampler - trainer| logprob (nats) of the weight-sync probe after the step's "
        "push into vLLM (NaN: no separate sampler)",
    ),
}


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
    """The daemon's metrics, registered on `registry` (the `grpod_` names of the contracts)."""

    def __init__(self, registry: CollectorRegistry, versions: dict[str, str] | None = None):
        super().__init__()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = (), mode: str = "mostrecent"):
            return Gauge(f"grpod_{name}", doc, labels, registry=registry, multiprocess_mode=mode)

        self.step = gauge("step", "Last finished step", mode="max")
        self.steps_total = Counter(
            "grpod_steps_total", "Steps by outcome", ["outcome"], registry=registry
        )
        for outcome in Outcome:
            self.steps_total.labels(outcome)
        self.report_gauges = {
            field: gauge(name, doc) for name, (field, doc) in REPORT_GAUGES.items()
        }
        self.clip_fraction = gauge("clip_fraction", "PPO clip fraction by side", ("side",))
        self.kv_evicted = gauge(
            "kv_cache_evicted_prompt_tokens",
            "Prompt tokens the bounded rollout cache had evicted by the first completion token, "
            "summed over the step's completions (NaN: dense cache)",
        )
        self.kv_fill = gauge(
            "kv_cache_fill_ratio", "Fraction of the rollout cache's slots in use after the prefill"
        )
        self.kv_slots = gauge(
            "kv_cache_slots", "Rollout KV cache slots per layer (NaN: dense)", ("policy",)
        )
        self.kv_protected = gauge(
            "kv_cache_protected_tokens",
            "Rollout cache tokens never evicted: attention sinks, H2O grace period",
            ("kind",),
        )
        # `reward` is one of the config's `rewards` ("module:function"): bounded by the config
        self.reward_function_mean = gauge(
            "reward_function_mean", "Mean of one reward function over the step", ("reward",)
        )
        self.reward_function_std = gauge(
            "reward_function_std", "Population std of one reward function", ("reward",)
        )
        self.eval_reward = gauge(
            "eval_reward",
            "Mean reward of the last held-out evaluation ('total': weighted)",
            ("reward",),
        )
        self.eval_step = gauge("eval_step", "Step of the last held-out evaluation", mode="max")
        self.correlation = gauge(
            "gradnorm_vtc_correlation", "Correlation of grad norm with 1/valid tokens (guards)"
        )
        self.findings_total = Counter(
            "grpod_findings_total", "Guard findings", ["guard", "action"], registry=registry
        )
        self.incidents_total = Counter(
            "grpod_incidents_total",
            "Incidents opened by the flight recorder (one per episode of a finding)",
            registry=registry,
        )
        self.incident_steps_total = Counter(
            "grpod_incident_steps_total",
            "Recorded steps with the finding of an incident's episode",
            registry=registry,
        )
        self.incidents_open = gauge("incidents_open", "Incidents whose episode is still open")
        self.phase_seconds = Histogram(
            "grpod_phase_duration_seconds",
            "Duration of each phase of a step",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.weight_sync_seconds = Histogram(
            "grpod_weight_sync_seconds",
            "Seconds of a weight sync into the sampler (vLLM's push, or the sharded run's "
            "rollout copy) and its check",
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        # async steps (engine/ahead.py); an on-policy step's staleness is 0
        self.rollout_staleness = Histogram(
            "grpod_rollout_staleness_steps",
            "Weight versions between the policy that sampled a trained batch and the policy "
            "that trains on it (0: on-policy)",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        )
        self.rollout_dropped_total = Counter(
            "grpod_rollout_dropped_total",
            "Rollouts dropped instead of trained on (stale: older than max_staleness)",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.rollout_dropped_total.labels(reason)
        self.rollout_overlap_seconds_total = Counter(
            "grpod_rollout_overlap_seconds_total",
            "Seconds of rollout sampling that ran while the trainer worked (async steps with "
            "a vllm-server)",
            registry=registry,
        )
        self.completion_tokens_total = Counter(
            "grpod_completion_tokens_total", "Completion tokens sampled", registry=registry
        )
        self.completions_total = Counter(
            "grpod_completions_total", "Completions sampled", registry=registry
        )
        self.last_step_timestamp = gauge(
            "last_step_timestamp_seconds", "Unix time the last step finished", mode="max"
        )
        self.recorder_queue_depth = gauge("recorder_queue_depth", "Steps waiting to be recorded")
        self.recorder_uncommitted_steps = gauge(
            "recorder_uncommitted_steps",
            "Steps taken by the recorder's writer and not yet committed (group commit)",
        )
        self.recorder_blocked_total = Counter(
            "grpod_recorder_blocked_total",
            "Steps that waited on a full recorder queue",
            registry=registry,
        )
        self.retained_bytes = gauge(
            "retained_bytes", "Bytes of checkpoints, batches and store kept after retention"
        )
        self.retention_over_budget_bytes = gauge(
            "retention_over_budget_bytes",
            "Bytes the run dir peaked over retention_bytes at the last checkpoint (0 = within)",
        )
        self.pruned_bytes_total = Counter(
            "grpod_pruned_bytes_total", "Bytes retention freed", registry=registry
        )
        self.pruned_total = Counter(
            "grpod_pruned_total",
            "Checkpoints and batch blobs retention deleted",
            ["kind"],
            registry=registry,
        )
        for kind in ("checkpoint", "batch"):
            self.pruned_total.labels(kind)
        # under torchrun: the loss divisor (each rank's own numbers: RankMetrics)
        self.global_valid_tokens = gauge(
            "global_valid_tokens", "The step's valid tokens over every rank (the loss divisor)"
        )
        self.halted = gauge("halted", "1 once a HALT verdict stopped the run", mode="max")
        self.verdict_action = gauge("verdict_action", "Last verdict: 0 PASS .. 3 HALT")
        self.build_info = gauge(
            "build_info", "grpod build", ("version", "torch", "transformers"), mode="max"
        )
        if versions:
            self.build_info.labels(
                versions.get("grpod", ""),
                versions.get("torch", ""),
                versions.get("transformers", ""),
            ).set(1)
        self.halted.set(0)
        self._seen = {"incidents": 0, "incident_steps": 0, "blocked": 0}
        self.campaign = CampaignMetrics(gauge)  # audit rewards, degeneration, reward_hacking

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
