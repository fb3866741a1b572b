"""GPU node check, numerics: logprob error against FP64, accumulation error, zeroed gradients.

On a random-init model of Qwen2-0.5B's shape (or W3's; a tiny one in a dry run):

- per-token logprob error |lp - lp_fp64| (p50/p90/p99/max, nats) for (a) bf16 trunk + grpod's
  FP32 chunked head (`engine.model.head.token_logprobs`), (b) bf16 trunk + bf16 head (logits and
  log-softmax in bf16), (c) FP32 trunk + FP32 head; the FP64 reference runs a float64 copy;
- the fraction of targets with FP64 p >= 0.88 whose gradient d lp / d logit_target (= 1 - p)
  comes out exactly 0 in each case;
- relative L2 error of the gradient summed over 16 and 256 micros (bf16 trunk, FP32 head)
  when the sum is kept in FP32 (grpod) or in bf16, against an FP64 sum of the same micros.

A random-init model's logits are nearly flat (a std of ~0.6 nats at Qwen2-0.5B's shape), so
no target would reach p >= 0.88 and bf16 rounding would look kinder than on a trained
policy. The check therefore scores at the largest temperature of `TEMPERATURES` at which a
third of the targets have p >= 0.88 (logits spread as a confident policy's are), and samples
the targets from the FP64 distribution at that temperature, as rollouts sample completions.
The engine's head divides the FP32 logits by the temperature; the bf16 head divides in bf16.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from common import build_model
from w3_mfu import W3_MODEL

from grpod.engine.model.head import token_logprobs
from grpod.engine.model.policy import compute_context, trunk_sizes

QWEN2_05B = {
    "vocab_size": 151936,
    **trunk_sizes(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2),
}
# a dry run's trunk, for every section that builds a model
TINY_TRUNK = trunk_sizes(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
TINY = {"vocab_size": 512, **TINY_TRUNK}
HIGH_P = 0.88  # ART: BF16 logits zero target gradients from about here
CONFIDENT_SHARE = 1 / 3  # the temperature is chosen so that this share reaches HIGH_P
TEMPERATURES = (1.0, 0.5, 0.3, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03)


def numerics(dry_run: bool, numerics_shape: str = "qwen2-0.5b") -> dict[str, Any]:
    device = torch.device("cpu" if dry_run else "cuda")
    if dry_run:
        shape, rows, seq, micros = TINY, 4, 32, (2, 4)
    elif numerics_shape == "w3":
        shape, rows, seq, micros = {**W3_MODEL, "vocab_size": 15}, 32, 64, (16, 256)
    else:
        shape, rows, seq, micros = QWEN2_05B, 32, 64, (16, 256)
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    model = build_model(**{**shape, "tie_word_embeddings": True}).to(device)
    build_seconds = time.perf_counter() - started
    tokens = torch.randint(shape["vocab_size"], (rows, seq), generator=gen).to(device)
    errors, zeroed = logprob_errors(model, tokens)
    accumulation = accumulation_errors(model, shape["vocab_size"], seq, micros, gen)
    return {
        "shape": {"name": "tiny" if dry_run else numerics_shape, **shape},
        "rows": rows,
        "seq": seq,
        "build_seconds": round(build_seconds, 2),
        "logprob_error_nats": errors,
        "zeroed_target_grad_fraction": zeroed,
        "grad_accumulation_rel_l2": accumulation,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def _hidden(model: torch.nn.Module, tokens: torch.Tensor, dtype: str) -> torch.Tensor:
    """Final-norm states `[rows * (seq - 1), H]` scoring each next token, as the engine runs
    the trunk (`compute_context`: bf16 autocast over the FP32 weights, or nothing)."""
    with torch.no_grad(), compute_context(dtype, tokens.device):
        hidden = model.base_model(input_ids=tokens).last_hidden_state[:, :-1]
    return hidden.reshape(-1, hidden.shape[-1]).float()


def _target_grads(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, d logprob / d logit_target)` in `logits`' own dtype: FP32 as grpod's head
    computes them (picked - logsumexp), bf16 as a bf16 head does (log-softmax in bf16)."""
    logits = logits.detach().requires_grad_(True)
    if logits.dtype == torch.float32:
        picked = logits.gather(-1, targets[:, None]).squeeze(-1)
        logprobs = picked - torch.logsumexp(logits, dim=-1)
    else:
        logprobs = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    return logprobs.detach(), grad.gather(-1, targets[:, None]).squeeze(-1)


def logprob_errors(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[dict, dict]:
    """Error quantiles of the three cases against FP64, and their zeroed-gradient fractions."""
    device = tokens.device
    weight = model.get_output_embeddings().weight.detach()
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        h64 = reference.base_model(input_ids=tokens).last_hidden_state[:, :-1]
        logits64 = h64.reshape(-1, h64.shape[-1]) @ reference.get_output_embeddings().weight.t()
    del reference, h64
    temperature, probs = _confident_temperature(logits64)
    targets = torch.multinomial(probs, 1, generator=torch.Generator(device).manual_seed(0)).squeeze(
        -1
    )
    del probs
    ref = (logits64 / temperature).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    del logits64
    confident = ref.exp() >= HIGH_P
    bf16_hidden, fp32_hidden = _hidden(model, tokens, "bfloat16"), _hidden(model, tokens, "float32")
    cases = {
        "bf16_trunk_fp32_head": (bf16_hidden, torch.float32),
        "bf16_trunk_bf16_head": (bf16_hidden, torch.bfloat16),
        "fp32": (fp32_hidden, torch.float32),
    }
    errors: dict[str, Any] = {"temperature": temperature}
    zeroed: dict[str, Any] = {"targets_p_ge_0_88": int(confident.sum()), "targets": len(targets)}
    for name, (hidden, dtype) in cases.items():
        with torch.no_grad():
            logits = (hidden.to(dtype) @ weight.to(dtype).t()) / temperature
        logprobs, grads = _target_grads(logits, targets)
        del logits
        if dtype == torch.float32:  # grpod's own head, chunked as W2 runs it
            with torch.no_grad():
                logprobs = token_logprobs(
                    hidden, weight, targets, chunks=4, temperature=temperature
                )
        errors[name] = quantiles((logprobs.double() - ref).abs())
        zeroed[name] = (
            round(float((grads[confident] == 0).float().mean()), 4) if confident.any() else None
        )
    return errors, zeroed


def _confident_temperature(logits64: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The largest of TEMPERATURES at which targets sampled from softmax(logits / T) have
    p >= HIGH_P with probability CONFIDENT_SHARE (the smallest if none does); its probs."""
    for temperature in TEMPERATURES:
        probs = (logits64 / temperature).softmax(-1)
        share = float((probs * (probs >= HIGH_P)).sum(-1).mean())
        if share >= CONFIDENT_SHARE:
            break
    return temperature, probs


def quantiles(values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values.double().cpu(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "p50": float(f"{q[0]:.3g}"),
        "p90": float(f"{q[1]:.3g}"),
        "p99": float(f"{q[2]:.3g}"),
        "max": float(f"{values.max():.3g}"),
    }


def accumulation_errors(
    model: torch.nn.Module, vocab: int, seq: int, micros: tuple[int, ...], gen: torch.Generator
) -> dict[str, dict[str, float]]:
    """Relative L2 of the FP32 and bf16 sums of per-micro gradients against their FP64 sum.

    Each micro is one fresh row of `seq` tokens, bf16 trunk + FP32 head, a GRPO-shaped loss
    (-advantage x logprob, advantages +-1); the grads are summed as they come (the 1/tokens
    scale grpod applies after the last micro scales both sides alike and is left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    fp32 = [torch.zeros_like(p) for p in params]
    bf16 = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    weight = model.get_output_embeddings().weight
    out = {}
    for m in range(1, max(micros) + 1):
        row = torch.randint(vocab, (1, seq), generator=gen).to(device)
        advantages = (torch.randint(2, (seq - 1,), generator=gen) * 2 - 1).float().to(device)
        with compute_context("bfloat16", device):
            hidden = model.base_model(input_ids=row).last_hidden_state[0, :-1]
        logprobs = token_logprobs(hidden.float(), weight, row[0, 1:], chunks=4)
        model.zero_grad(set_to_none=True)
        (-(advantages * logprobs).sum()).backward()
        for p, e, f, b in zip(params, exact, fp32, bf16):
            e.add_(p.grad)  # an FP32 gradient added into FP64: exact
            f.add_(p.grad)
            b.add_(p.grad.bfloat16())  # what a bf16 model's bf16 .grad accumulates
        if m in micros:
            out[str(m)] = {"fp32": _rel_l2(fp32, exact), "bf16": _rel_l2(bf16, exact)}
    model.zero_grad(set_to_none=True)
    return out


def _rel_l2(values: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """||values - exact|| / ||exact|| over every parameter, one parameter at a time."""
    error = sum(float((v.double() - e).norm()) ** 2 for v, e in zip(values, exact))
    norm = sum(float(e.norm()) ** 2 for e in exact)
    return float(f"{(error / norm) ** 0.5:.3g}")
