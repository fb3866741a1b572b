"""FP32 head and FP32 gradient accumulation on a bf16 model, against float64 references."""

import pytest
import torch

from grpod.engine import Engine, TransportBatch
from grpod.engine.model.head import token_logprobs
from tests.engine.helpers import config


def _hidden_and_targets(
    engine: Engine, batch: TransportBatch | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = batch or engine.rollout()
    hidden, source = engine.forward_backward.trunk(engine.model, batch, 0)
    if isinstance(source, torch.Tensor):  # the batch's index tensors live on the CPU
        source = source.to(hidden.device)
    hidden, targets = hidden[source], batch.input_ids[0].reshape(-1).to(hidden.device)
    index = batch.loss_mask[0].reshape(-1).to(hidden.device).nonzero().squeeze(-1)
    weight = engine.model.get_output_embeddings().weight
    return hidden[index - 1].detach(), weight.detach(), targets[index]


def _f64_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = hidden.double() @ weight.double().t()
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def test_fp32_chunked_head_matches_float64_on_a_bf16_model() -> None:
    engine = Engine(config(dtype="bfloat16", prompts_per_step=8, lmhead_chunks=4))
    batch = engine.rollout()
    hidden, weight, targets = _hidden_and_targets(engine, batch)
    fp32_hidden, _, _ = _hidden_and_targets(Engine(config(prompts_per_step=8)), batch)
    assert (hidden - fp32_hidden).abs().max() > 1e-3  # the trunk really ran in bf16
    reference = _f64_logprobs(hidden, weight, targets)
    fp32 = token_logprobs(hidden, weight, targets, chunks=4).double()
    delta = (fp32 - reference).abs()
    assert torch.quantile(delta, 0.99) <= 1e-4
    # the same measurement with a BF16 head shows what the FP32 head avoids
    with torch.autocast("cpu", enabled=False):
        logits = hidden.bfloat16() @ weight.bfloat16().t()
        bf16 = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1).double()
    bf16_p99 = torch.quantile((bf16 - reference).abs(), 0.99)
    assert bf16_p99 > 100 * torch.quantile(delta, 0.99).clamp(min=1e-7)
    assert bf16_p99 > 1e-3


def test_chunked_head_equals_unchunked_and_grads_agree() -> None:
    engine = Engine(config())
    hidden, weight, targets = _hidden_and_targets(engine)
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    one = token_logprobs(h1, weight, targets, chunks=1)
    many = token_logprobs(h2, weight, targets, chunks=5)
    assert torch.allclose(one, many, atol=1e-6)
    one.sum().backward()
    many.sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6)


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_fp32_accumulation_over_64_bf16_micros_vs_float64() -> None:
    cfg = config(
        dtype="bfloat16", prompts_per_step=16, group_size=4, micro_batch_rows=1, pack=False
    )
    engine = Engine(cfg)
    batch = engine.rollout()
    assert batch.num_micros == 64
    # each micro's own gradient, then the engine's FP32 accumulation of all of them
    per_micro = []
    for m in range(batch.num_micros):
        engine.model.zero_grad(set_to_none=True)
        single = batch.reorder([m, *[i for i in range(batch.num_micros) if i != m]])
        hidden, source = engine.forward_backward.trunk(engine.model, single, 0)
        loss = engine.forward_backward.chunk_losses(single, 0, hidden, source, None, _Stats())
        loss.backward()
        per_micro.append([p.grad.double().clone() for p in engine.params])
    engine.model.zero_grad(set_to_none=True)
    report = engine.accumulate(batch)
    scale = 1.0 / report.valid_tokens
    got = torch.cat([p.grad.double().reshape(-1) for p in engine.params])
    exact = torch.cat([sum(g[i] for g in per_micro).reshape(-1) for i in range(len(engine.params))])
    exact = exact * scale
    rel = (got - exact).norm() / exact.norm()
    assert rel <= 1e-6, rel
    # what BF16 accumulation would have done
    bf16 = [torch.zeros_like(p, dtype=torch.bfloat16) for p in engine.params]
    for grads in per_micro:
        for acc, g in zip(bf16, grads):
            acc += g.bfloat16()
    rel_bf16 = (
        torch.cat([b.double().reshape(-1) for b in bf16]) * scale - exact
    ).norm() / exact.norm()
    assert rel_bf16 > 100 * max(float(rel), 1e-9)
    engine.flush()


class _Stats:
    def add_chunk(self, *args) -> None:
        pass

    def add_logprobs(self, *args) -> None:
        pass
