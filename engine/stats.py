"""Per-step statistics gathered while a step accumulates, folded into its `StepReport`."""

from __future__ import annotations

import math

import torch

from grpod.engine.advantages import group_advantages
from grpod.engine.batch import TransportBatch
from grpod.engine.report import ChunkTrace, KVCacheReport, StepReport
from grpod.engine.rewards import reward_stats


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

    def report(
        self,
        batch: TransportBatch,
        *,
        valid_tokens: int,
        token_scale: float,
        grad_norm: float,
        max_grad_norm: float,
        lr: float,
    ) -> StepReport:
        loss_sums = [float(x) for x in self.micro_loss_sums]
        rewards = batch.rewards
        group_size = max(
            1, batch.num_samples // max(1, int(batch.sample_group_ids.unique().numel()))
        )
        _, zero_std = group_advantages(rewards, group_size) if batch.num_samples else (None, 0.0)
        mismatch = _mismatch(self.trainer_lp, self.sampler_lp)
        tokens = max(int(self.tokens), 1)
        lengths = batch.completion_lengths.float()
        return StepReport(
            step=batch.step,
            valid_tokens=valid_tokens,
            expected_valid_tokens=batch.expected_valid_tokens(),
            loss=sum(loss_sums) * token_scale,
            micro_losses=[x * token_scale for x in loss_sums],
            grad_norm=grad_norm,
            clip_coef=min(1.0, max_grad_norm / (grad_norm + 1e-6))
            if grad_norm == grad_norm
            else 0.0,
            lr=lr,
            reward_mean=float(rewards.mean()) if batch.num_samples else 0.0,
            reward_std=float(rewards.std(correction=0)) if batch.num_samples else 0.0,
            zero_std_group_fraction=zero_std,
            advantage_abs_max=float(batch.advantages.abs().max())
            if batch.advantages.numel()
            else 0.0,
            kl=None if self.kl_sum is None else float(self.kl_sum) / tokens,
            entropy=None
            if self.entropy_sum is None
            else float(self.entropy_sum) / self.entropy_tokens,
            clip_fraction_low=float(self.clipped_low) / tokens,
            clip_fraction_high=float(self.clipped_high) / tokens,
            completion_length_mean=float(lengths.mean()) if lengths.numel() else 0.0,
            completion_length_max=int(lengths.max()) if lengths.numel() else 0,
            num_micros=batch.num_micros,
            num_samples=batch.num_samples,
            micro_order=list(batch.micro_order or range(batch.num_micros)),
            chunk_trace=[
                ChunkTrace(m, c, int(n), float(loss), int(after))
                for m, c, n, loss, after in self.trace
            ],
            kv_cache=_kv_cache(batch),
            reward_functions=reward_stats(batch.function_rewards),
            weight_version=batch.weight_version,
            weight_sync_max_abs_logprob_diff=None
            if batch.weight_sync is None
            else batch.weight_sync.max_abs_diff,
            **mismatch,
        )


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
    keys = ("mean", "p90", "p99", "max", "frac_above_0_1")
    if not sampler or not trainer:
        return {f"mismatch_{k}": None for k in keys}
    delta = (torch.cat(sampler).cpu() - torch.cat(trainer).cpu()).abs().double()
    if delta.numel() == 0:
        return {f"mismatch_{k}": None for k in keys}
    q = torch.quantile(delta, torch.tensor([0.9, 0.99], dtype=torch.float64)).tolist()
    values = (delta.mean(), q[0], q[1], delta.max(), (delta > 0.1).double().mean())
    return {f"mismatch_{k}": float(v) for k, v in zip(keys, values)}
