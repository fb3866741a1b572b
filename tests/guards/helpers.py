"""Builders of hand-made batches and reports for the guards' unit tests."""

from __future__ import annotations

import torch

from engine import StepReport, TransportBatch


def batch(
    mask: list[list[int]] | torch.Tensor | None = None,
    *,
    chunks: int = 1,
    advantages: float = 1.0,
    rewards: list[float] | None = None,
    sampler: float | None = -1.0,
    step: int = 0,
    rows: int = 1,
) -> TransportBatch:
    """A batch of `[micros, rows, seq]` from a 0/1 loss mask per flattened micro."""
    loss_mask = torch.as_tensor(mask if mask is not None else [[0, 1, 1, 0]], dtype=torch.bool)
    loss_mask = loss_mask.reshape(loss_mask.shape[0], rows, -1)  # [micros, rows, seq]
    shape = loss_mask.shape
    rewards_t = torch.tensor(rewards if rewards is not None else [1.0, 0.0], dtype=torch.float32)
    return TransportBatch(
        input_ids=torch.ones(shape, dtype=torch.int64),
        position_ids=torch.arange(shape[-1]).expand(shape).clone(),
        loss_mask=loss_mask,
        advantages=loss_mask.float() * advantages,
        sampler_logprobs=None if sampler is None else loss_mask.float() * sampler,
        sample_ids=torch.zeros(shape, dtype=torch.int32),
        group_ids=torch.zeros(shape, dtype=torch.int32),
        rewards=rewards_t,
        sample_group_ids=torch.zeros(len(rewards_t), dtype=torch.int32),
        completion_lengths=torch.ones(len(rewards_t), dtype=torch.int32),
        step=step,
        config_digest="test",
        sequence_chunks=chunks,
    )


def report(**overrides: object) -> StepReport:
    """A healthy step's report; `overrides` change any field."""
    fields = dict(
        step=0,
        valid_tokens=10,
        expected_valid_tokens=10,
        loss=0.01,
        micro_losses=[0.005, 0.005],
        grad_norm=0.5,
        clip_coef=1.0,
        lr=1e-3,
        reward_mean=0.5,
        reward_std=0.5,
        zero_std_group_fraction=0.25,
        advantage_abs_max=1.0,
        kl=None,
        clip_fraction_low=0.0,
        clip_fraction_high=0.0,
        mismatch_mean=1e-6,
        mismatch_p90=1e-6,
        mismatch_p99=1e-6,
        mismatch_max=1e-6,
        mismatch_frac_above_0_1=0.0,
        completion_length_mean=2.0,
        completion_length_max=4,
        num_micros=2,
        num_samples=2,
    )
    fields.update(overrides)
    return StepReport(**fields)
