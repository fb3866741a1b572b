"""Per-step statistics gathered while a step accumulates, and the one function that builds
the step's `StepReport` from them (`build_report`; a skipped step's: `skipped_report`).

The report's arithmetic that another trainer's adapter shares (grpod/integrations/trl_batch.py)
is here once: `clip_coefficient` and `mismatch_stats`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.data.advantages import group_advantages
from grpod.engine.data.audit import completion_stats
from grpod.engine.data.rewards import reward_stats
from grpod.engine.report import ChunkTrace, KVCacheReport, StepReport


class StepStats:
    """Per-chunk trace and token statistics gathered while a step accumulates."""

    def __init__(self) -> None:
        self.trace: list[tuple] = []
        self.micro_loss_sums: list[torch.Tensor] = []
        self.trainer_lp: list[torch.Tensor] = []
        self.sampler_lp: list[torch.Tensor] = []
        self.clipped_low = self.clipped_high = self.tokens = 0
        self.kl_sum: torch.Tensor | None = None
        self.entropy_sum: torch.Tensor | None = None  # policy entropy over trainable tokens
        self.entropy_tokens = 0
        self.valid_tokens = 0  # the counter's step total, once the passes ran

    def add_chunk(self, micro, chunk, tokens, loss, counter, token_loss) -> None:
        self.trace.append((micro, chunk, tokens, loss.detach(), counter._count))
        self.clipped_low += token_loss.clipped_low.sum()
        self.clipped_high += token_loss.clipped_high.sum()
        self.tokens += token_loss.loss.numel()
        if token_loss.kl is not None:
            kl = token_loss.kl.detach().sum()
            self.kl_sum = kl if self.kl_sum is None else self.kl_sum + kl

    def add_logprobs(
        self,
        trainer: torch.Tensor,
        sampler: torch.Tensor | None,
        entropy: torch.Tensor | None = None,
    ) -> None:
        self.trainer_lp.append(trainer)
        if entropy is not None and entropy.numel():
            part = entropy.double().sum()
            self.entropy_sum = part if self.entropy_sum is None else self.entropy_sum + part
            self.entropy_tokens += entropy.numel()
        if sampler is not None:
            self.sampler_lp.append(sampler)

    @property
    def loss_sum(self) -> float:
        """This rank's loss sum over every micro (not yet divided by any count)."""
        return sum(float(x) for x in self.micro_loss_sums)


@dataclass(frozen=True)
class StepTotals:
    """What a step measured once its passes ran: the counts and the gradient's scale and norm.

    `ranks`: every rank's `[valid tokens, expected valid tokens, loss sum]` (one row in one
    process); `global_valid_tokens`: the loss divisor (their sum, or a replay's recorded one).
    """

    rank: int
    world_size: int
    ranks: list[list[float]]
    global_valid_tokens: int
    token_scale: float  # 1 / global_valid_tokens (engine/train/accounting.py `token_scale`)
    grad_norm: float  # global FP32 norm of the scaled gradients, before clipping
    max_grad_norm: float
    lr: float


def build_report(batch: TransportBatch, stats: StepStats, totals: StepTotals) -> StepReport:
    """The step's `StepReport`, built once from the batch as run, what its passes gathered
    (`stats`) and what the step measured after them (`totals`)."""
    loss_sums = [float(x) for x in stats.micro_loss_sums]
    scale, grad_norm = totals.token_scale, totals.grad_norm
    tokens, of_batch = _token_stats(stats), _batch_stats(batch)
    if batch.weight_sync is not None:  # the rollout's half of the check, where it has one
        of_batch["weight_sync_max_abs_logprob_diff"] = batch.weight_sync.with_rollout(
            tokens["mismatch_max"]
        )
    return StepReport(
        step=batch.step,
        valid_tokens=stats.valid_tokens,
        expected_valid_tokens=batch.expected_valid_tokens(),
        loss=sum(r[2] for r in totals.ranks) * scale,
        micro_losses=[x * scale for x in loss_sums],
        grad_norm=grad_norm,
        clip_coef=clip_coefficient(grad_norm, totals.max_grad_norm),
        lr=totals.lr,
        rank=totals.rank,
        world_size=totals.world_size,
        global_valid_tokens=totals.global_valid_tokens,
        rank_expected_valid_tokens=[int(r[1]) for r in totals.ranks],
        local_loss=sum(loss_sums) * scale,
        micro_order=list(batch.micro_order or range(batch.num_micros)),
        chunk_trace=[
            ChunkTrace(m, c, int(n), float(loss), int(after))
            for m, c, n, loss, after in stats.trace
        ],
        **tokens,
        **of_batch,
    )


def skipped_report(batch: TransportBatch, *, rank: int, world_size: int, lr: float) -> StepReport:
    """The report of a step flushed without its compute (a guard's skip-fast)."""
    return StepReport(
        step=batch.step,
        valid_tokens=0,
        expected_valid_tokens=batch.expected_valid_tokens(),
        loss=0.0,
        micro_losses=[],
        grad_norm=0.0,
        clip_coef=1.0,
        lr=lr,
        rank=rank,
        world_size=world_size,
        skipped_compute=True,
        micro_order=list(range(batch.num_micros)),
        **_token_stats(StepStats()),
        **_batch_stats(batch),
    )


def _token_stats(stats: StepStats) -> dict[str, Any]:
    """KL, entropy, clip fractions and sampler mismatch over the step's trainable tokens."""
    tokens = max(int(stats.tokens), 1)
    return {
        "kl": None if stats.kl_sum is None else float(stats.kl_sum) / tokens,
        "entropy": None
        if stats.entropy_sum is None
        else float(stats.entropy_sum) / stats.entropy_tokens,
        "clip_fraction_low": float(stats.clipped_low) / tokens,
        "clip_fraction_high": float(stats.clipped_high) / tokens,
        **_mismatch(stats.trainer_lp, stats.sampler_lp),
    }


def _batch_stats(batch: TransportBatch) -> dict[str, Any]:
    """What the report says of the batch itself: rewards, advantages, lengths, the rollout."""
    rewards = batch.rewards
    group_size = max(1, batch.num_samples // max(1, batch.num_groups))
    _, zero_std = group_advantages(rewards, group_size) if batch.num_samples else (None, 0.0)
    lengths = batch.completion_lengths.float()
    return {
        "reward_mean": float(rewards.mean()) if batch.num_samples else 0.0,
        "reward_std": float(rewards.std(correction=0)) if batch.num_samples else 0.0,
        "zero_std_group_fraction": zero_std,
        "advantage_abs_max": float(batch.advantages.abs().max())
        if batch.advantages.numel()
        else 0.0,
        "completion_length_mean": float(lengths.mean()) if lengths.numel() else 0.0,
        "completion_length_max": int(lengths.max()) if lengths.numel() else 0,
        "num_micros": batch.num_micros,
        "num_samples": batch.num_samples,
        "kv_cache": _kv_cache(batch),
        "reward_functions": reward_stats(batch.function_rewards),
        "audit_rewards": reward_stats(batch.audit_rewards),
        "completion_stats": completion_stats(batch) if batch.num_samples else {},
        "weight_version": batch.weight_version,
        "staleness": batch.staleness,
        "weight_sync_max_abs_logprob_diff": None
        if batch.weight_sync is None
        else batch.weight_sync.max_abs_diff,
    }


def _kv_cache(batch: TransportBatch) -> KVCacheReport | None:
    """The batch's bounded-cache settings and the rollout's cache state, when it had one."""
    spec = batch.kv_cache
    if spec is None:
        return None
    stats = batch.kv_cache_stats
    return KVCacheReport(
        policy=spec.policy,
        length=spec.length,
        sink_tokens=spec.sinks,
        grace_period=spec.grace,
        prompt_tokens_evicted=math.nan if stats is None else stats.prompt_tokens_evicted,
        fill=math.nan if stats is None else stats.fill,
    )


def _mismatch(trainer: list[torch.Tensor], sampler: list[torch.Tensor]) -> dict[str, float | None]:
    """|sampler - trainer| logprob statistics over trainable tokens, from the same forward."""
    if not sampler or not trainer:
        return mismatch_stats(None, None)
    return mismatch_stats(torch.cat(sampler), torch.cat(trainer))


CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: the coefficient the optimizer step applies
MISMATCH_KEYS = ("mean", "p90", "p99", "max", "frac_above_0_1")


def clip_coefficient(grad_norm: float, max_grad_norm: float) -> float:
    """The factor clipping scales the gradients by, as `clip_grad_norm_` computes it:
    `min(1, max_grad_norm / (grad_norm + 1e-6))`. A non-finite norm (NaN, inf) gives 0.0: the
    step is flushed by the finite guard, and 0 never reads as "unclipped". `max_grad_norm`
    <= 0 (clipping off, as TRL's `max_grad_norm=0`) gives 1.0 for a finite norm."""
    if not math.isfinite(grad_norm):
        return 0.0
    if max_grad_norm <= 0:
        return 1.0
    return min(1.0, max_grad_norm / (grad_norm + CLIP_EPS))


def mismatch_stats(
    sampler: torch.Tensor | None, trainer: torch.Tensor | None
) -> dict[str, float | None]:
    """|sampler - trainer| logprob statistics (nats) over a step's trainable tokens:
    `mismatch_{mean,p90,p99,max,frac_above_0_1}`. `sampler`, `trainer`: `[tokens]` the
    logprobs of the same tokens; every value None without both, or without a token."""
    if sampler is None or trainer is None or sampler.numel() == 0:
        return {f"mismatch_{k}": None for k in MISMATCH_KEYS}
    delta = (sampler.cpu() - trainer.cpu()).abs().double()
    q = torch.quantile(delta, torch.tensor([0.9, 0.99], dtype=torch.float64)).tolist()
    values = (delta.mean(), q[0], q[1], delta.max(), (delta > 0.1).double().mean())
    return {f"mismatch_{k}": float(v) for k, v in zip(MISMATCH_KEYS, values)}
