"""GPU node check, in-process kernels: W3 MFU, and flashinfer against the torch sampler.

- `mfu`: bench/w3_mfu.py's W3 steps on CUDA with a bf16 trunk; the training pass's FLOP/s
  (w3_mfu.training_flops) over an 8192^3 bf16 matmul on random data timed before every step;
- `flashinfer`: if it imports, its top-p sampling against `engine.rollout`'s top-p filter +
  multinomial on the same logits (total variation distance of each to the exact filtered
  distribution over many draws; time per call at Qwen2's vocabulary), and its single-sequence
  decode attention against SDPA on the same K/V (relative error, time). A dry run, and a node
  where it does not import, compare the torch path with itself so the comparison code runs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from gpu_env import flashinfer_status
from gpu_numerics import TINY_TRUNK
from w3_mfu import matmul_flops_per_s, measure, save_w3_model, w3_engine

from grpod.engine.rollout.torch_sampler import filter_top_p

TOP_P = 0.9


def mfu(dry_run: bool) -> dict[str, Any]:
    if dry_run:
        shape = TINY_TRUNK
        settings = dict(max_new_tokens=4, prompts_per_step=2, group_size=2, seq_len=16)
        n, steps, device, dtype = 256, 1, "cpu", torch.float32
    else:
        shape, settings, n, steps, device, dtype = {}, {}, 8192, 10, "cuda", torch.bfloat16
    with tempfile.TemporaryDirectory() as model_dir:
        save_w3_model(model_dir, **shape)
        engine = w3_engine(model_dir, device=device, dtype="bfloat16", **settings)
    record = measure(engine, steps, lambda: matmul_flops_per_s(n, 5, device, dtype))
    record["peak_matmul"] = f"{dtype} {n}^3 on {device}, median of 5, before every step"
    return record


# ------------------------------------------------------------------ flashinfer
def _torch_top_p(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The torch sampler's draw (engine/rollout/torch_sampler.py): top-p, then multinomial."""
    logprobs = filter_top_p(probs.log(), TOP_P).log_softmax(-1)
    return torch.multinomial(logprobs.exp(), 1, generator=gen).squeeze(-1)


def _flashinfer_top_p(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    import flashinfer

    return flashinfer.sampling.top_p_sampling_from_probs(probs, TOP_P, generator=gen).long()


def flashinfer(dry_run: bool) -> dict[str, Any]:
    status = flashinfer_status()
    device = "cpu" if dry_run else "cuda"
    usable = status["importable"] and not dry_run
    other: Callable = _flashinfer_top_p if usable else _torch_top_p
    out: dict[str, Any] = {**status, "compared": "flashinfer" if usable else "torch (itself)"}
    for name, fn in (("sampling", _sampling), ("decode_attention", _decode)):
        try:
            out[name] = fn(other if name == "sampling" else usable, device, dry_run)
        except Exception as exc:  # a kernel that does not build here: say what stopped it
            out[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]}
    if not status["importable"]:
        out.update(status="skipped", reason=status["reason"])
    elif any(out[k].get("status") == "error" for k in ("sampling", "decode_attention")):
        out.update(status="failed", reason="a flashinfer kernel failed (see its entry)")
    return out


def _sampling(sampler: Callable, device: str, dry_run: bool) -> dict[str, Any]:
    """Draws from one small distribution, many times: each sampler's total variation distance
    to the exact top-p distribution; then the time per call at a large vocabulary."""
    gen = torch.Generator(device).manual_seed(0)
    vocab, draws = 64, 4096 if dry_run else 262144
    logits = torch.randn(1, vocab, generator=gen, device=device) * 2
    exact = filter_top_p(logits, TOP_P).softmax(-1)[0]
    probs = logits.softmax(-1).expand(draws, vocab).contiguous()
    result = {"vocab": vocab, "draws": draws, "top_p": TOP_P}
    for name, fn in (("torch", _torch_top_p), ("other", sampler)):
        counts = torch.bincount(fn(probs, gen), minlength=vocab).double()
        result[f"tv_distance_{name}"] = float(0.5 * (counts / draws - exact.double()).abs().sum())
    big = torch.randn(8 if dry_run else 256, 512 if dry_run else 151936, device=device)
    big = (big * 3).softmax(-1)
    result["seconds_per_call"] = {
        "torch": _time(lambda: _torch_top_p(big, gen), device),
        "other": _time(lambda: sampler(big, gen), device),
    }
    return result


def _decode(usable: bool, device: str, dry_run: bool) -> dict[str, Any]:
    """One query token against a K/V cache (Qwen2-0.5B's 14 query / 2 K/V heads of 64)."""
    gen = torch.Generator(device).manual_seed(0)
    heads, kv_heads, dim, length = 14, 2, 64, 256 if dry_run else 4096
    dtype = torch.float32 if dry_run else torch.bfloat16
    q = torch.randn(heads, dim, generator=gen, device=device).to(dtype)
    k = torch.randn(length, kv_heads, dim, generator=gen, device=device).to(dtype)
    v = torch.randn(length, kv_heads, dim, generator=gen, device=device).to(dtype)

    def reference() -> torch.Tensor:
        rep = heads // kv_heads
        keys = k.permute(1, 0, 2).repeat_interleave(rep, 0)  # [heads, length, dim]
        values = v.permute(1, 0, 2).repeat_interleave(rep, 0)
        out = torch.nn.functional.scaled_dot_product_attention(q[:, None], keys, values)
        return out[:, 0]

    def other() -> torch.Tensor:
        if not usable:
            return reference()
        import flashinfer

        return flashinfer.decode.single_decode_with_kv_cache(q, k, v)

    want, got = reference().double(), other().double()
    return {
        "kv_length": length,
        "dtype": str(dtype),
        "rel_error": float((got - want).norm() / want.norm()),
        "seconds_per_call": {"torch": _time(reference, device), "other": _time(other, device)},
    }


def _time(fn: Callable[[], Any], device: str, repeats: int = 20) -> float:
    """Median seconds per call (CUDA events on a GPU), after two warm-up calls."""
    import statistics
    import time

    fn(), fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return float(f"{statistics.median(times):.4g}")
