"""The optimizer and LR schedule: AdamW over the trained parameters, warmup then constant or
cosine, and the step that applies one accumulated update (clip, AdamW, schedule)."""

from __future__ import annotations

import functools
import math

import torch

from grpod.engine.config import EngineConfig


def build_optimizer(
    params: list[torch.nn.Parameter], config: EngineConfig, device: torch.device
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.adam_betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        # one kernel per parameter instead of ~10 ops each (CPU and CUDA have it)
        fused=device.type in ("cpu", "cuda") or None,
    )


def build_schedule(
    optimizer: torch.optim.Optimizer, config: EngineConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Its `last_epoch` is the number of updates applied: the policy's weight version."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config))


def lr_factor(config: EngineConfig, applied: int) -> float:
    """The LR multiplier after `applied` updates: linear warmup, then constant or cosine."""
    if applied < config.warmup_steps:
        return (applied + 1) / config.warmup_steps
    if config.lr_schedule == "cosine":
        progress = min(1.0, (applied - config.warmup_steps) / max(1, config.total_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def apply_update(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    *,
    grad_norm: float,
    max_grad_norm: float,
    clip_coef: float,
    device: torch.device,
) -> None:
    """Clip with the step's pre-clip `grad_norm` (not a second norm), AdamW, advance the
    schedule, drop the gradients."""
    if clip_coef < 1.0:
        torch.nn.utils.clip_grads_with_norm_(
            params, max_grad_norm, torch.tensor(grad_norm, device=device)
        )
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
