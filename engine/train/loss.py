"""The GRPO loss, FP32 whatever the model dtype.

Completion token p is scored by the logits at p-1. The LM head and log-softmax run in FP32
over `lmhead_chunks` chunks of tokens; with more than one chunk each is recomputed in the
backward pass, so the full `[tokens, vocab]` logits never exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP32 logprobs `[tokens]` of `targets`, and (`entropy`) each token's entropy `[tokens]`
    in nats of the same (temperature-scaled) distribution, detached: it is reported, never
    differentiated, so it adds one pass over the chunk's logits and no saved tensor."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = hidden.float() @ weight.float().t()
        if temperature != 1.0:
            logits = logits / temperature
        picked = logits.gather(-1, targets[:, None]).squeeze(-1)
        lse = torch.logsumexp(logits, dim=-1)
        if not entropy:
            return picked - lse, None
        with torch.no_grad():
            # H = -sum(p log p) over log p = z - logsumexp(z): no cancellation of two large
            # terms when the policy is nearly deterministic (the collapse it is there to see)
            log_p = logits.detach() - lse.detach()[:, None]
            ent = -(torch.exp(log_p) * log_p).sum(-1)
        return picked - lse, ent


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunks: int = 1,
    temperature: float = 1.0,
) -> torch.Tensor:
    """FP32 logprobs `[tokens]` of `targets: [tokens]` given `hidden: [tokens, H]`."""
    return token_logprobs_entropy(
        hidden, weight, targets, chunks=chunks, temperature=temperature, entropy=False
    )[0]


def token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunks: int = 1,
    temperature: float = 1.0,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, and (`entropy`) the policy's per-token entropy `[tokens]` in nats,
    detached, computed chunk by chunk from the same FP32 logits (no full-logit tensor)."""
    if chunks <= 1 or hidden.shape[0] <= 1:
        return _head(hidden, weight, targets, temperature, entropy)
    logprobs, ent = _ChunkedHead.apply(hidden, weight, targets, chunks, temperature, entropy)
    return logprobs, ent if entropy else None


class _ChunkedHead(torch.autograd.Function):
    """The head's logprobs chunk by chunk of rows, each chunk's `[rows, vocab]` logits
    recomputed in the backward: what activation checkpointing of the plain `_head` per chunk
    does, without its hooks on every saved tensor (those cost ~25% of W2's training pass at
    `lmhead_chunks` 4, bench/README.md). The forward is `_head` op for op (its second output,
    the detached entropy, is empty when not asked for); the backward is the log-softmax
    gradient `g * (onehot(target) - softmax) / temperature`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks: int, temperature: float, entropy: bool):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunks, ctx.temperature = chunks, temperature
        parts = [
            _head(h, weight, t, temperature, entropy)
            for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks))
        ]
        logprobs = torch.cat([lp for lp, _ in parts])
        ent = torch.cat([e for _, e in parts]) if entropy else logprobs.new_empty(0)
        ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        w32 = weight.float()
        grad_hidden = []
        grad_weight = torch.zeros_like(w32) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            splits = zip(
                hidden.tensor_split(ctx.chunks),
                targets.tensor_split(ctx.chunks),
                grad_out.tensor_split(ctx.chunks),
            )
            for h, t, g in splits:
                h32 = h.float()
                logits = h32 @ w32.t()
                if ctx.temperature != 1.0:
                    logits = logits / ctx.temperature
                # d(picked - logsumexp)/d logits = onehot(target) - softmax(logits)
                grad_logits = torch.softmax(logits, dim=-1).mul_(-g[:, None])
                grad_logits.scatter_add_(-1, t[:, None], g[:, None])
                if ctx.temperature != 1.0:
                    grad_logits = grad_logits / ctx.temperature
                if want_hidden:
                    grad_hidden.append(grad_logits @ w32)
                if want_weight:
                    grad_weight.addmm_(grad_logits.t(), h32)
        return (
            torch.cat(grad_hidden).to(hidden.dtype) if want_hidden else None,
            grad_weight.to(weight.dtype) if want_weight else None,
            None,
            None,
            None,
            None,
        )


_FP32_MIN, _FP32_MAX = torch.finfo(torch.float32).min, torch.finfo(torch.float32).max


@dataclass(frozen=True)
class LossSettings:
    kind: str = "ppo"  # ppo | cispo
    eps_low: float = 0.2
    eps_high: float = 0.2
    logratio_clamp: float = 20.0
    tis_cap: float = 0.0
    kl_beta: float = 0.0


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
