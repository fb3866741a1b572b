"""The chunked FP32 head's own backward against float64 and against plain autograd."""

from __future__ import annotations

import pytest
import torch

from grpod.engine.loss import _head_logprobs, token_logprobs


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator).to(dtype)
    weight = torch.randn(11, 16, generator=generator)
    targets = torch.randint(0, 11, (37,), generator=generator)
    return hidden, weight, targets


def _grads(fn, hidden, weight, targets, temperature):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fn(h, w, targets, temperature)
    (out * torch.linspace(-2.0, 3.0, out.numel(), dtype=out.dtype)).sum().backward()
    return out.detach(), h.grad, w.grad


def _float64(h, w, targets, temperature):
    logits = h @ w.t() / temperature
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_float64_and_plain_autograd(temperature: float) -> None:
    hidden, weight, targets = _inputs()
    chunked = _grads(
        lambda h, w, t, temp: token_logprobs(h, w, t, chunks=4, temperature=temp),
        hidden,
        weight,
        targets,
        temperature,
    )
    plain = _grads(_head_logprobs, hidden, weight, targets, temperature)
    exact = _grads(_float64, hidden.double(), weight.double(), targets, temperature)
    assert torch.equal(chunked[0], plain[0])  # the forward is the plain head, op for op
    for ours, theirs, reference in zip(chunked[1:], plain[1:], exact[1:]):
        scale = reference.abs().max()
        assert (ours.double() - reference).abs().max() <= 1e-6 * scale
        assert (theirs.double() - reference).abs().max() <= 1e-6 * scale
        assert not torch.equal(ours, torch.zeros_like(ours))


def test_chunked_head_gradient_dtypes_and_frozen_weight() -> None:
    hidden, weight, targets = _inputs(torch.bfloat16)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    token_logprobs(h, w, targets, chunks=3).sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32

    frozen = weight.clone()  # a reference model's head: no gradient wanted or made
    h = hidden.float().requires_grad_(True)
    out = token_logprobs(h, frozen, targets, chunks=3)
    out.sum().backward()
    assert frozen.grad is None and h.grad is not None
    with torch.no_grad():  # scoring: the forward alone
        assert torch.equal(token_logprobs(hidden.float(), weight, targets, chunks=3), out.detach())
