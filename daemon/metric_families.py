"""The tables `Metrics` is built from (daemon/metrics.py): every family's name, type, help
and labels. Dashboards, alert rules and their promtool tests read these names: a change here
is a change of the contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grpod.engine.verdict import Outcome

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8)  # max_staleness is at most 8 (engine config)
DROP_REASONS = ("stale",)  # engine/rollout/ahead.py
ATTRIBUTION_STATUSES = ("done", "skipped", "failed", "stopped")  # forensics.incident_attribution
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
        "Largest |sampler - trainer| logprob (nats) of the weight-sync check after the step's "
        "push into vLLM: the probe's, or its cache half and the rollout's own tokens on an "
        "on-policy float32 step (NaN: no separate sampler)",
    ),
}


@dataclass(frozen=True)
class Family:
    """One metric family of `Metrics`, kept in the attribute `attr`: `grpod_<name>`, its help
    and labels; a gauge's multiprocess mode, a histogram's buckets, and the label values whose
    series exist from the start (a counter reads 0 before its first increment)."""

    attr: str
    kind: type  # Gauge, Counter or Histogram
    name: str
    help: str
    labels: tuple[str, ...] = ()
    mode: str = "mostrecent"  # a gauge's, under torchrun's multiprocess files
    buckets: tuple[float, ...] = ()  # a histogram's
    series: tuple[Any, ...] = ()

    def make(self, registry: CollectorRegistry) -> Any:
        name = f"grpod_{self.name}"
        if self.kind is Gauge:
            metric = Gauge(
                name, self.help, self.labels, registry=registry, multiprocess_mode=self.mode
            )
        elif self.kind is Histogram:
            metric = Histogram(
                name, self.help, self.labels, buckets=self.buckets, registry=registry
            )
        else:
            metric = Counter(name, self.help, self.labels, registry=registry)
        for value in self.series:
            metric.labels(value)
        return metric


G, C, H = Gauge, Counter, Histogram
# before the REPORT_GAUGES (the order of a scrape)
STEP_FAMILIES = (
    Family("step", G, "step", "Last finished step", mode="max"),
    Family(
        "steps_total", C, "steps_total", "Steps by outcome", ("outcome",), series=tuple(Outcome)
    ),
)
FAMILIES = (
    Family("clip_fraction", G, "clip_fraction", "PPO clip fraction by side", ("side",)),
    Family(
        "kv_evicted",
        G,
        "kv_cache_evicted_prompt_tokens",
        "Prompt tokens the bounded rollout cache had evicted by the first completion token, "
        "summed over the step's completions (NaN: dense cache)",
    ),
    Family(
        "kv_fill",
        G,
        "kv_cache_fill_ratio",
        "Fraction of the rollout cache's slots in use after the prefill",
    ),
    Family(
        "kv_slots",
        G,
        "kv_cache_slots",
        "Rollout KV cache slots per layer (NaN: dense)",
        ("policy",),
    ),
    Family(
        "kv_protected",
        G,
        "kv_cache_protected_tokens",
        "Rollout cache tokens never evicted: attention sinks, H2O grace period",
        ("kind",),
    ),
    # `reward` is one of the config's `rewards` ("module:function"): bounded by the config
    Family(
        "reward_function_mean",
        G,
        "reward_function_mean",
        "Mean of one reward function over the step",
        ("reward",),
    ),
    Family(
        "reward_function_std",
        G,
        "reward_function_std",
        "Population std of one reward function",
        ("reward",),
    ),
    Family(
        "eval_reward",
        G,
        "eval_reward",
        "Mean reward of the last held-out evaluation ('total': weighted)",
        ("reward",),
    ),
    Family("eval_step", G, "eval_step", "Step of the last held-out evaluation", mode="max"),
    Family(
        "correlation",
        G,
        "gradnorm_vtc_correlation",
        "Correlation of grad norm with 1/valid tokens (guards)",
    ),
    Family("findings_total", C, "findings_total", "Guard findings", ("guard", "action")),
    Family(
        "incidents_total",
        C,
        "incidents_total",
        "Incidents opened by the flight recorder (one per episode of a finding)",
    ),
    Family(
        "incident_steps_total",
        C,
        "incident_steps_total",
        "Recorded steps with the finding of an incident's episode",
    ),
    Family("incidents_open", G, "incidents_open", "Incidents whose episode is still open"),
    Family(
        "incident_attributions_total",
        C,
        "incident_attributions_total",
        "Incident attributions stored, by status (done; skipped, failed or stopped: a note)",
        ("status",),
        series=ATTRIBUTION_STATUSES,
    ),
    Family(
        "incident_attribution",
        G,
        "incident_attribution_timestamp_seconds",
        "Unix time the last incident's attribution was stored, labelled with its incident id, "
        "step, top sample and the module where a NaN was born (one series: the last)",
        ("incident", "step", "sample", "module"),
    ),
    Family(
        "phase_seconds",
        H,
        "phase_duration_seconds",
        "Duration of each phase of a step",
        ("phase",),
        buckets=PHASE_BUCKETS,
    ),
    Family(
        "weight_sync_seconds",
        H,
        "weight_sync_seconds",
        "Seconds of a weight sync into the sampler (vLLM's push, or the sharded run's "
        "rollout copy) and its check",
        buckets=PHASE_BUCKETS,
    ),
    # async steps (engine/rollout/ahead.py); an on-policy step's staleness is 0
    Family(
        "rollout_staleness",
        H,
        "rollout_staleness_steps",
        "Weight versions between the policy that sampled a trained batch and the policy "
        "that trains on it (0: on-policy)",
        buckets=STALENESS_BUCKETS,
    ),
    Family(
        "rollout_dropped_total",
        C,
        "rollout_dropped_total",
        "Rollouts dropped instead of trained on (stale: older than max_staleness)",
        ("reason",),
        series=DROP_REASONS,
    ),
    Family(
        "rollout_overlap_seconds_total",
        C,
        "rollout_overlap_seconds_total",
        "Seconds of rollout sampling that ran while the trainer worked (async steps with "
        "a vllm-server)",
    ),
    Family("completion_tokens_total", C, "completion_tokens_total", "Completion tokens sampled"),
    Family("completions_total", C, "completions_total", "Completions sampled"),
    Family(
        "last_step_timestamp",
        G,
        "last_step_timestamp_seconds",
        "Unix time the last step finished",
        mode="max",
    ),
    Family(
        "recorder_queue_depth",
        G,
        "recorder_queue_depth",
        "Steps (and checkpoints, evals) in the recorder's inbox, not yet taken by its writer",
    ),
    Family(
        "recorder_uncommitted_steps",
        G,
        "recorder_uncommitted_steps",
        "Steps taken by the recorder's writer and not yet committed (group commit)",
    ),
    Family(
        "recorder_blocked_total",
        C,
        "recorder_blocked_total",
        "Steps that waited on a full recorder queue",
    ),
    Family(
        "retained_bytes",
        G,
        "retained_bytes",
        "Bytes of checkpoints, batches and store kept after retention",
    ),
    Family(
        "retention_over_budget_bytes",
        G,
        "retention_over_budget_bytes",
        "Bytes the run dir peaked over retention_bytes at the last checkpoint (0 = within)",
    ),
    Family("pruned_bytes_total", C, "pruned_bytes_total", "Bytes retention freed"),
    Family(
        "pruned_total",
        C,
        "pruned_total",
        "Checkpoints and batch blobs retention deleted",
        ("kind",),
        series=("checkpoint", "batch"),
    ),
    # under torchrun: the loss divisor (each rank's own numbers: RankMetrics)
    Family(
        "global_valid_tokens",
        G,
        "global_valid_tokens",
        "The step's valid tokens over every rank (the loss divisor)",
    ),
    Family("halted", G, "halted", "1 once a HALT verdict stopped the run", mode="max"),
    Family("verdict_action", G, "verdict_action", "Last verdict: 0 PASS .. 3 HALT"),
    Family(
        "build_info",
        G,
        "build_info",
        "grpod build",
        ("version", "torch", "transformers"),
        mode="max",
    ),
)
