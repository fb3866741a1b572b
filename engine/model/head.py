"""The FP32 head: token logprobs from the trunk's hidden states, whatever the model dtype.

Completion token p is scored by the logits at p-1. The LM head and log-softmax run in FP32
over `chunks` chunks of tokens; with more than one chunk each is recomputed in the backward
pass, so the full `[tokens, vocab]` logits never exist at once. Training's loss
(engine/train/loss.py) and the rollout's weight-sync check (`sequence_logprobs`) both score
through it, so the two can never disagree on how a token is scored.
"""

from __future__ import annotations

import torch

from grpod.engine.model.policy import compute_context
from grpod.engine.model.trunk import trunk_hidden


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


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, tokens: list[int], dtype: str, device: torch.device
) -> torch.Tensor:
    """FP32-head logprobs `[len(tokens) - 1]` of tokens 1.. given the ones before, at
    temperature 1, through the trainer's own trunk (`trunk_hidden`) and compute dtype."""
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = torch.arange(len(tokens), device=device)[None]
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device).tril()
    with compute_context(dtype, device):
        hidden = trunk_hidden(model, ids, positions, causal[None, None], dtype)
    head = model.get_output_embeddings().weight
    return token_logprobs(hidden[0, :-1], head, ids[0, 1:]).float().cpu()
