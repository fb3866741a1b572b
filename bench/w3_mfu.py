"""W3 `small-lm`: achieved FLOP/s of grpod's training pass over a torch matmul peak.

    .venv/bin/python bench/w3_mfu.py [--steps 12]

The W3 Qwen2 (hidden 512, intermediate 1536, 8 layers, 8 heads, 4 KV heads, the W1 vocab,
torch seed 0) is saved to a temporary directory with the local tokenizer and loaded by the
engine like any local model. Each step's training pass (`take_phase_seconds()["grad"]`: forward,
FP32 head, loss and backward over every micro) is timed, and between steps an FP32 square
matmul is timed in the same process, so both see the same machine load. FLOPs count what the
trunk actually runs (tokens of the trunk layout: shared prompts once, no unread tails) at
6 x linear parameters per token plus causal attention, and the FP32 head on scored tokens.
Prints one JSON line with the same figures as W1 plus `mfu` = median achieved / median peak.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from common import THREADS, build_hf_tokenizer, build_model, emit, engine_config, peak_rss_mib

from grpod.engine.model.policy import trunk_sizes

W3_MODEL = trunk_sizes(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4)


def matmul_flops_per_s(
    n: int = 1024, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of an n x n x n torch matmul of `dtype` on `device` (median of `repeats`
    timings; on CUDA each timing waits for the product, on random data, never zeros)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - started)
    return 2 * n**3 / statistics.median(times)


def training_flops(engine, batch) -> tuple[float, int]:
    """FLOPs of one training pass over `batch` and the number of tokens the trunk ran."""
    from grpod.engine.train.layout import trunk_layout

    cfg = engine.model.config
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = hidden // heads
    linear = layers * (
        2 * hidden * hidden  # q, o
        + 2 * hidden * kv * head_dim  # k, v
        + 3 * hidden * cfg.intermediate_size  # gate, up, down
    )
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    flops, tokens = 0.0, 0
    for micro in range(batch.num_micros):
        layout = trunk_layout(
            batch.input_ids[micro],
            batch.position_ids[micro],
            batch.sample_ids[micro],
            batch.loss_mask[micro],
        )
        visible = int(layout.attention_mask[..., :, :].sum()) - int(
            layout.attention_mask.shape[0] * layout.attention_mask.shape[-1]
        )  # key positions attended to, padding's self-attention removed
        run = layout.tokens
        tokens += run
        # forward 2 FLOPs per MAC, backward twice the forward
        flops += 6 * linear * run
        flops += 3 * layers * 2 * 2 * heads * head_dim * max(visible, 0)
        flops += 6 * hidden * vocab * int(batch.loss_mask[micro].sum())
    return flops, tokens


def w3_engine(model_dir: str, **overrides):
    """The engine on W3's settings (8 prompts x 8 completions, 32 new tokens) over the
    model saved in `model_dir`."""
    from grpod.engine import Engine

    settings = dict(max_new_tokens=32, prompts_per_step=8, group_size=8)
    return Engine(engine_config("arith", model=model_dir, **{**settings, **overrides}))


def save_w3_model(model_dir: str, **shape) -> None:
    """W3's Qwen2 (torch seed 0; `shape` overrides it) and the local tokenizer, saved."""
    build_model(**{**W3_MODEL, **shape}).save_pretrained(model_dir)
    build_hf_tokenizer().save_pretrained(model_dir)


def measure(engine, steps: int, peak: Callable[[], float]) -> dict:
    """`steps` W3 steps; the training pass's FLOP/s against `peak()` timed before each."""
    params = sum(p.numel() for p in engine.model.parameters())
    step_s, grad_s, achieved, peaks, rewards, tokens_out, run_tokens = [], [], [], [], [], [], []
    for _ in range(steps):
        peaks.append(peak())
        started = time.perf_counter()
        batch = engine.rollout()
        report = engine.accumulate(batch)
        engine.apply()
        step_s.append(time.perf_counter() - started)
        flops, tokens = training_flops(engine, batch)
        grad = engine.take_phase_seconds()["grad"]
        grad_s.append(grad)
        achieved.append(flops / grad)
        rewards.append(report.reward_mean)
        tokens_out.append(int(batch.completion_lengths.sum()))
        run_tokens.append(tokens)
    window = slice(2, None) if steps > 2 else slice(None)  # steps 3..N
    median_step = statistics.median(step_s[window])
    median_achieved = statistics.median(achieved[window])
    median_peak = statistics.median(peaks)
    return {
        "workload": "W3",
        "steps": steps,
        "params": params,
        "grpod": {
            "median_s_per_step": round(median_step, 4),
            "completions_per_s": round(len(batch.rewards) / median_step, 1),
            "completion_tokens_per_s": round(statistics.mean(tokens_out[window]) / median_step, 1),
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "reward_first5": round(statistics.mean(rewards[:5]), 4),
            "reward_last5": round(statistics.mean(rewards[-5:]), 4),
            "median_grad_s": round(statistics.median(grad_s[window]), 4),
            "trunk_tokens_per_step": round(statistics.mean(run_tokens[window]), 1),
        },
        "achieved_gflop_per_s": round(median_achieved / 1e9, 2),
        "matmul_peak_gflop_per_s": round(median_peak / 1e9, 2),
        "mfu": round(median_achieved / median_peak, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as model_dir:
        save_w3_model(model_dir)
        engine = w3_engine(model_dir)
    record = measure(engine, args.steps, matmul_flops_per_s)
    record["peak_matmul"] = "fp32 1024x1024x1024, median of 5, timed before every step"
    emit(record)


if __name__ == "__main__":
    main()
