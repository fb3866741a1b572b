"""`StepReport`: everything the engine knows about one step, for guards, metrics and the store."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from grpod.base.jsonsafe import from_json, to_json


@dataclass
class ChunkTrace:
    """One chunk invocation, in the order it ran."""

    micro: int  # micro index in the batch as run
    chunk: int  # sequence chunk of the flattened micro
    valid_tokens: int  # trainable tokens in this chunk
    loss_sum: float  # sum of per-token losses in this chunk
    counter_after: int  # the engine counter right after this chunk


@dataclass
class KVCacheReport:
    """The rollout's bounded KV cache: the settings in force and its state after the prefill."""

    policy: str  # lastrec | h2o
    length: int  # slots per layer
    sink_tokens: int
    grace_period: int
    prompt_tokens_evicted: float  # summed over the step's completions (layers, heads averaged)
    fill: float  # mean fraction of slots in use


@dataclass(frozen=True)
class RankReport:
    """One rank's part of a distributed step, as rank 0 records it (daemon/distributed.py)."""

    rank: int
    valid_tokens: int  # the rank's local count
    expected_valid_tokens: int
    local_loss: float | None  # the rank's loss sum / the step's global valid tokens
    num_micros: int
    num_samples: int
    phase_seconds: dict[str, float] = field(default_factory=dict)
    chunk_trace: list[ChunkTrace] = field(default_factory=list)

    @classmethod
    def of(cls, report: StepReport, phase_seconds: dict[str, float]) -> RankReport:
        """The rank's numbers from its own `StepReport` (every field but the phase seconds is
        the report's field of the same name) and its step's phase seconds."""
        taken = {f.name: getattr(report, f.name) for f in fields(cls) if f.name != "phase_seconds"}
        taken["chunk_trace"] = list(report.chunk_trace)
        return cls(**taken, phase_seconds=dict(phase_seconds))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankReport:
        return cls(
            **{k: from_json(v) for k, v in data.items() if k != "chunk_trace"},
            chunk_trace=[ChunkTrace(**c) for c in data.get("chunk_trace", [])],
        )


@dataclass
class StepReport:
    step: int
    valid_tokens: int  # the engine's step counter
    expected_valid_tokens: int  # host-side sum of the loss mask
    loss: float
    micro_losses: list[float]  # each micro's loss sum / the step's valid tokens
    grad_norm: float  # global FP32 norm before clipping
    clip_coef: float  # min(1, max_grad_norm / grad_norm)
    lr: float
    reward_mean: float
    reward_std: float
    zero_std_group_fraction: float
    advantage_abs_max: float
    kl: float | None
    clip_fraction_low: float
    clip_fraction_high: float
    mismatch_mean: float | None  # |sampler - trainer logprob| over trainable tokens
    mismatch_p90: float | None
    mismatch_p99: float | None
    mismatch_max: float | None
    mismatch_frac_above_0_1: float | None
    completion_length_mean: float
    completion_length_max: int
    num_micros: int
    num_samples: int
    micro_order: list[int] = field(default_factory=list)
    chunk_trace: list[ChunkTrace] = field(default_factory=list)
    skipped_compute: bool = False
    kv_cache: KVCacheReport | None = None  # None: the dense rollout cache
    # mean policy entropy (nats) per trainable token, from the FP32 head; None when not computed
    entropy: float | None = None
    # `[engine] rewards`: each function's {"mean", "std"} over the step's completions
    reward_functions: dict[str, dict[str, float]] = field(default_factory=dict)
    # `[engine] audit_rewards` (never trained on): each one's {"mean", "std"}; {} on steps not
    # audited; and the completions' degeneration statistics (engine/data/audit.py)
    audit_rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    completion_stats: dict[str, float] = field(default_factory=dict)
    # scale-out (engine/model/parallel.py); one process: rank 0 of 1, global == local
    rank: int = 0
    world_size: int = 1
    global_valid_tokens: int | None = None  # Σ over ranks of valid_tokens: the loss divisor
    rank_expected_valid_tokens: list[int] = field(default_factory=list)  # all-gathered
    local_loss: float | None = None  # this rank's loss sum / global_valid_tokens
    rank_reports: list[RankReport] = field(default_factory=list)  # recorded: every rank's
    # the weights the rollout sampled with (engine/weight_sync.py; from the batch)
    weight_version: int | None = None
    # nats, the whole check (both halves where the rollout has one); None: no separate sampler
    weight_sync_max_abs_logprob_diff: float | None = None
    staleness: int | None = None  # max_staleness > 0: versions behind the policy (the batch's)

    SCALARS = (
        "valid_tokens",
        "expected_valid_tokens",
        "loss",
        "grad_norm",
        "clip_coef",
        "lr",
        "reward_mean",
        "reward_std",
        "zero_std_group_fraction",
        "advantage_abs_max",
        "kl",
        "entropy",
        "clip_fraction_low",
        "clip_fraction_high",
        "mismatch_mean",
        "mismatch_p90",
        "mismatch_p99",
        "mismatch_max",
        "mismatch_frac_above_0_1",
        "completion_length_mean",
        "completion_length_max",
        "num_micros",
        "num_samples",
    )

    def scalars(self) -> dict[str, float | int | None]:
        """The report's scalar fields (for metrics, logs and the store)."""
        return {name: getattr(self, name) for name in self.SCALARS}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; non-finite floats become the strings 'nan', 'inf', '-inf'."""
        return to_json(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepReport:
        names = {f.name for f in fields(cls)}
        kwargs = {k: from_json(v) for k, v in data.items() if k in names}
        kwargs["chunk_trace"] = [ChunkTrace(**c) for c in data.get("chunk_trace", [])]
        if data.get("kv_cache") is not None:
            kwargs["kv_cache"] = KVCacheReport(**kwargs["kv_cache"])
        kwargs["rank_reports"] = [RankReport.from_dict(r) for r in data.get("rank_reports", [])]
        return cls(**kwargs)
