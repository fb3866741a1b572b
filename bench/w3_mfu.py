"""W3 `small-lm`: achieved FLOP/s of grpod's training pass over a torch matmul peak.

    .venv/bin/python bench/w3_mfu.py [--steps 12]

The W3 Qwen2 (hidden 512, intermediate 1536, 8 layers, 8 heads, 4 KV heads, the W1 vocab,
torch seed 0) is saved to a temporary directory with the local tokenizer and loaded by the
engine like any local model. Each step's training pass (`phase_seconds["grad"]`: forward,
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

import torch
from common import THREADS, build_hf_tokenizer, build_model, emit, engine_config, peak_rss_mib

W3_MODEL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def matmul_flops_per_s(n: int = 1024, repeats: int = 5) -> float:
    """FP32 FLOP/s of an n x n x n torch matmul (median of `repeats` timings)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * n**3 / statistics.median(times)


def training_flops(engine, batch) -> tuple[float, int]:
    """FLOPs of one training pass over `batch` and the number of tokens the trunk ran."""
    from grpod.engine.packing import trunk_layout

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from grpod.engine import Engine

    with tempfile.TemporaryDirectory() as model_dir:
        build_model(**W3_MODEL).save_pretrained(model_dir)
        build_hf_tokenizer().save_pretrained(model_dir)
        engine = Engine(
            engine_config(
                "arith", model=model_dir, max_new_tokens=32, prompts_per_step=8, group_size=8
            )
        )
    params = sum(p.numel() for p in engine.model.parameters())
    step_s, grad_s, achieved, peaks, rewards, tokens_out, run_tokens = [], [], [], [], [], [], []
    for _ in range(args.steps):
        peaks.append(matmul_flops_per_s())
        started = time.perf_counter()
        batch = engine.rollout()
        report = engine.accumulate(batch)
        engine.apply()
        step_s.append(time.perf_counter() - started)
        flops, tokens = training_flops(engine, batch)
        grad_s.append(report.phase_seconds["grad"])
        achieved.append(flops / report.phase_seconds["grad"])
        rewards.append(report.reward_mean)
        tokens_out.append(int(batch.completion_lengths.sum()))
        run_tokens.append(tokens)
    window = slice(2, None)  # steps 3..N
    median_step = statistics.median(step_s[window])
    median_achieved = statistics.median(achieved[window])
    median_peak = statistics.median(peaks)
    emit(
        {
            "workload": "W3",
            "steps": args.steps,
            "params": params,
            "grpod": {
                "median_s_per_step": round(median_step, 4),
                "completions_per_s": round(64 / median_step, 1),
                "completion_tokens_per_s": round(
                    statistics.mean(tokens_out[window]) / median_step, 1
                ),
                "peak_rss_mib": round(peak_rss_mib(), 1),
                "reward_first5": round(statistics.mean(rewards[:5]), 4),
                "reward_last5": round(statistics.mean(rewards[-5:]), 4),
                "median_grad_s": round(statistics.median(grad_s[window]), 4),
                "trunk_tokens_per_step": round(statistics.mean(run_tokens[window]), 1),
            },
            "achieved_gflop_per_s": round(median_achieved / 1e9, 2),
            "matmul_peak_gflop_per_s": round(median_peak / 1e9, 2),
            "mfu": round(median_achieved / median_peak, 3),
            "peak_matmul": "fp32 1024x1024x1024, median of 5, timed before every step",
        }
    )


if __name__ == "__main__":
    main()
