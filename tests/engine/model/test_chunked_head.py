"""The chunked FP32 head's own backward against float64 and against plain autograd."""

from __future__ import annotations

import pytest
import torch

from grpod.engine.model.head import token_logprobs, token_logprobs_entropy


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
    plain = _grads(  # one chunk: the plain head under autograd
        lambda h, w, t, temp: token_logprobs(h, w, t, temperature=temp),
        hidden,
        weight,
        targets,
        temperature,
    )
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


@pytest.mark.parametrize("chunks", [1, 4])
def test_entropy_matches_float64_and_leaves_gradients_alone(chunks: int) -> None:
    hidden, weight, targets = _inputs()
    h = hidden.clone().requires_grad_(True)
    logprobs, entropy = token_logprobs_entropy(h, weight, targets, chunks=chunks, temperature=0.7)
    logits = hidden.double() @ weight.double().t() / 0.7
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy.double(), expected, rtol=1e-5, atol=1e-5)
    assert bool((entropy > 0).all()) and bool((entropy < torch.log(torch.tensor(11.0))).all())
    logprobs.sum().backward()
    plain = hidden.clone().requires_grad_(True)
    token_logprobs(plain, weight, targets, chunks=chunks, temperature=0.7).sum().backward()
    assert torch.equal(h.grad, plain.grad)  # the entropy pass changes no gradient bit


def test_step_report_carries_the_policy_entropy() -> None:
    from grpod.engine import Engine, EngineConfig

    config = {"task": "copy", "prompts_per_step": 2, "group_size": 4, "threads": 1}
    one, four = (
        Engine(EngineConfig.model_validate({**config, "lmhead_chunks": n})) for n in (1, 4)
    )
    batch = one.rollout()
    reports = [engine.accumulate(batch) for engine in (one, four)]
    assert 0.5 < reports[0].entropy < float(torch.log(torch.tensor(15.0)))  # random init
    assert reports[1].entropy == pytest.approx(reports[0].entropy, rel=1e-6)
    assert reports[0].scalars()["entropy"] == reports[0].entropy
