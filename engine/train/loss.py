"""The GRPO loss, FP32 whatever the model dtype.

Completion token p is scored by the logits at p-1 through the FP32 head
(engine/model/head.py), over `lmhead_chunks` chunks of tokens; with more than one chunk each
is recomputed in the backward pass, so the full `[tokens, vocab]` logits never exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpod.engine.config import EngineConfig

_FP32_MIN, _FP32_MAX = torch.finfo(torch.float32).min, torch.finfo(torch.float32).max


@dataclass(frozen=True)
class LossSettings:
    kind: str = "ppo"  # ppo | cispo
    eps_low: float = 0.2
    eps_high: float = 0.2
    logratio_clamp: float = 20.0
    tis_cap: float = 0.0
    kl_beta: float = 0.0

    @classmethod
    def of(cls, config: EngineConfig) -> LossSettings:
        """`config`'s loss settings: the kind is its `loss`, the rest its fields by name."""
        same = {f.name: getattr(config, f.name) for f in fields(cls) if f.name != "kind"}
        return cls(kind=config.loss, **same)


@dataclass
class TokenLoss:
    loss: torch.Tensor  # [tokens] FP32, per-token loss before normalisation
    clipped_low: torch.Tensor  # [tokens] bool
    clipped_high: torch.Tensor  # [tokens] bool
    kl: torch.Tensor | None  # [tokens] FP32 k3 estimate, when kl_beta > 0


def finite_floor(logprobs: torch.Tensor) -> torch.Tensor:
    """A detached logprob with ±inf moved to the FP32 range, so differences stay finite."""
    return torch.nan_to_num(logprobs, nan=float("nan"), neginf=_FP32_MIN, posinf=_FP32_MAX)


def clamped_ratio(logprobs: torch.Tensor, base: torch.Tensor, clamp: float) -> torch.Tensor:
    """exp(logprobs - base), the log-ratio clamped to ±clamp first (-inf base stays finite)."""
    return torch.exp((logprobs - finite_floor(base)).clamp(-clamp, clamp))


def policy_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    settings: LossSettings,
    *,
    sampler_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> TokenLoss:
    """Per-token PPO-clip or CISPO loss, with optional TIS weights and k3 KL."""
    ratio = clamped_ratio(logprobs, old_logprobs, settings.logratio_clamp)
    low, high = 1.0 - settings.eps_low, 1.0 + settings.eps_high
    if settings.kind == "ppo":
        loss = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    else:  # cispo: a clipped, detached IS weight on the REINFORCE term
        loss = -ratio.clamp(max=high).detach() * advantages * logprobs
    clipped_low = (ratio < low) & (advantages < 0)
    clipped_high = (ratio > high) & (advantages > 0)
    if settings.tis_cap > 0:
        assert sampler_logprobs is not None  # checked by the trainer with a clear error
        weight = clamped_ratio(
            finite_floor(old_logprobs), sampler_logprobs, settings.logratio_clamp
        )
        loss = loss * weight.clamp(max=settings.tis_cap).detach()
    kl = None
    if ref_logprobs is not None and settings.kl_beta > 0:
        delta = (ref_logprobs - logprobs).clamp(-settings.logratio_clamp, settings.logratio_clamp)
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + settings.kl_beta * kl
    return TokenLoss(loss, clipped_low, clipped_high, kl)
