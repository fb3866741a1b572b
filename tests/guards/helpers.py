"""Builders of hand-made batches and reports for the guards' unit tests."""

from __future__ import annotations

import torch

from grpod.engine import StepReport, TransportBatch
from tests.batches import make_batch
from tests.reports import make_report


def batch(
    mask: list[list[int]] | torch.Tensor | None = None,
    *,
    chunks: int = 1,
    advantages: float = 1.0,
    rewards: list[float] | None = None,
    sampler: float | None = -1.0,
    step: int = 0,
    rows: int = 1,
    groups: int = 1,
) -> TransportBatch:
    """A batch of `[micros, rows, seq]` from a 0/1 loss mask per flattened micro; its samples
    in `groups` groups (one sample each beyond the rewards given)."""
    loss_mask = torch.as_tensor(mask if mask is not None else [[0, 1, 1, 0]], dtype=torch.bool)
    loss_mask = loss_mask.reshape(loss_mask.shape[0], rows, -1)  # [micros, rows, seq]
    shape = loss_mask.shape
    rewards_t = torch.tensor(rewards if rewards is not None else [1.0, 0.0], dtype=torch.float32)
    if groups > len(rewards_t):
        rewards_t = torch.cat([rewards_t, torch.zeros(groups - len(rewards_t))])
    grouped = {"sample_group_ids": torch.arange(len(rewards_t), dtype=torch.int32) % groups}
    return make_batch(
        loss_mask=loss_mask,
        input_ids=torch.ones(shape, dtype=torch.int64),
        position_ids=torch.arange(shape[-1]).expand(shape).clone(),
        advantages=loss_mask.float() * advantages,
        sampler_logprobs=None if sampler is None else loss_mask.float() * sampler,
        sample_ids=torch.zeros(shape, dtype=torch.int32),
        rewards=rewards_t,
        completion_lengths=torch.ones(len(rewards_t), dtype=torch.int32),
        step=step,
        sequence_chunks=chunks,
        **(grouped if groups > 1 else {}),
    )


def report(**overrides: object) -> StepReport:
    """A healthy step's report; `overrides` change any field."""
    return make_report(**overrides)
