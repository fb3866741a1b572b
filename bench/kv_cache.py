"""Long-context rollouts through a bounded KV cache: memory and time, dense vs lastrec vs h2o.

    .venv/bin/python bench/kv_cache.py [--cache-length 128] [--multiples 2 4 8]
    .venv/bin/python bench/kv_cache.py --learning --steps 40 [--plot docs/kv-cache-learning.png]

Memory: each (policy, prompt length) rolls out in a fresh process (the tiny Qwen2, random
init, 8 prompts x 8 completions of `--new-tokens`), which resets the kernel's high-water mark
right before `engine.rollout.sample` and reads `VmHWM` after it (as bench/w2_memory.py
does); `cache_mib` is the decode cache's own tensors (keys, values, slot positions, H2O
scores) as the decoder allocated them. Seconds are the median of `--repeats` rollouts in
one process, the three policies interleaved round by round.

Learning (`--learning`): the same seed and steps on `kv-retrieval` with prompts longer than
the cache, the asked key early (first quarter of the records) or late (last quarter), for
each policy; the reward curves, and a PNG with `--plot`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import emit, engine_config, in_child, reset_peak, set_threads, status_kib

POLICIES = ("dense", "lastrec", "h2o")
MIB = 1024 * 1024


def _setup(policy: str, prompt_len: int, args: dict):
    """The model, prompts, cache spec and sampler settings of one (policy, prompt length)."""
    import torch

    from grpod.engine.kvcache import KVCacheSpec, default_sinks
    from grpod.engine.model.policy import build_tiny_qwen2

    length, new = args["cache_length"], args["new_tokens"]
    model = build_tiny_qwen2(44, prompt_len + new, seed=0)
    spec = None
    if policy != "dense":
        spec = KVCacheSpec(policy, length, default_sinks(length), 0)
    gen = torch.Generator().manual_seed(0)
    distinct = [
        [1, *torch.randint(3, 44, (prompt_len - 1,), generator=gen).tolist()] for _ in range(8)
    ]
    prompts = [p for p in distinct for _ in range(8)]
    # eos -1: no row stops early, every rollout decodes `new` tokens
    settings = dict(max_new_tokens=new, temperature=1.0, top_p=1.0, eos_token_id=-1, pad_token_id=0)
    return model, prompts, spec, settings


def _memory_worker(conn, policy: str, prompt_len: int, args: dict) -> None:
    set_threads()
    import torch

    import grpod.engine.rollout.torch_sampler as rollout

    built = []
    for name in ("StaticDecoder", "BoundedDecoder"):  # keep the decoder to measure its cache
        cls = getattr(rollout, name)
        setattr(rollout, name, lambda *a, _cls=cls, **k: built.append(_cls(*a, **k)) or built[-1])
    model, prompts, spec, settings = _setup(policy, prompt_len, args)
    before = reset_peak()
    rollout.sample(
        model, prompts, generator=torch.Generator().manual_seed(0), kv_cache=spec, **settings
    )
    peak = status_kib("VmHWM") / 1024 - before
    tensors = [t for layer in built[-1].cache for t in _cache_tensors(layer)]
    conn.send(
        {
            "policy": policy,
            "prompt_tokens": prompt_len,
            "rollout_peak_mib": round(peak, 1),
            "cache_mib": round(sum(t.numel() * t.element_size() for t in tensors) / MIB, 2),
        }
    )


def _cache_tensors(layer) -> list:
    if isinstance(layer, tuple):  # StaticDecoder: (keys, values)
        return list(layer)
    return [t for t in (layer.keys, layer.values, layer.positions, layer.scores) if t is not None]


def _seconds(prompt_len: int, args: dict) -> dict[str, float]:
    """Median seconds per rollout of each policy, the policies interleaved round by round (the
    machine's load drifts; interleaving exposes the three to the same drift)."""
    import torch

    from grpod.engine.rollout.torch_sampler import sample

    setups = {policy: _setup(policy, prompt_len, args) for policy in POLICIES}
    times: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for r in range(args["repeats"]):
        for policy, (model, prompts, spec, settings) in setups.items():
            started = time.perf_counter()
            sample(
                model,
                prompts,
                generator=torch.Generator().manual_seed(r),
                kv_cache=spec,
                **settings,
            )
            times[policy].append(time.perf_counter() - started)
    return {policy: round(statistics.median(t), 3) for policy, t in times.items()}


def memory(args: argparse.Namespace) -> None:
    # children: large buffers straight from mmap, so the high-water mark tracks live memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    settings = vars(args)
    rows = [
        in_child(_memory_worker, policy, m * args.cache_length, settings)
        for m in args.multiples
        for policy in POLICIES
    ]
    set_threads()
    for m in args.multiples:
        seconds = _seconds(m * args.cache_length, settings)
        for row in rows:
            if row["prompt_tokens"] == m * args.cache_length:
                row["seconds_per_rollout"] = seconds[row["policy"]]
    by = {(r["policy"], r["prompt_tokens"]): r for r in rows}
    ratios = {
        f"{policy}_over_dense_{m}x": {
            key: round(
                by[policy, m * args.cache_length][key] / by["dense", m * args.cache_length][key], 3
            )
            for key in ("rollout_peak_mib", "cache_mib", "seconds_per_rollout")
        }
        for m in args.multiples
        for policy in POLICIES[1:]
    }
    emit(
        {
            "workload": "kv-cache-rollout",
            "model": "tiny-qwen2 (hidden 128, 4 layers, 2 KV heads)",
            "rows": 64,
            "cache_length": args.cache_length,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "rollouts": rows,
            "ratios": ratios,
        }
    )


def _learning_worker(conn, policy: str, asked: str, args: dict) -> None:
    set_threads()
    from grpod.engine import Engine

    records = tuple(args["records"])
    overrides = dict(
        seq_len=5 * records[1] + 5 + args["new_tokens"],
        kv_retrieval_records=records,
        kv_retrieval_asked=asked,
        max_new_tokens=args["new_tokens"],
        prompts_per_step=args["prompts"],
        group_size=8,
        micro_batch_rows=8,
        tis_cap=2.0,  # every arm the same loss (h2o requires it)
        seed=0,
    )
    if policy != "dense":
        overrides.update(rollout_kv_cache=policy, kv_cache_length=args["cache_length"])
    engine = Engine(engine_config("kv-retrieval", **overrides))
    rewards, seconds = [], []
    for _ in range(args["steps"]):
        started = time.perf_counter()
        report = engine.accumulate(engine.rollout())
        engine.apply()
        seconds.append(time.perf_counter() - started)
        rewards.append(round(report.reward_mean, 4))
    conn.send(
        {
            "policy": policy,
            "asked": asked,
            "rewards": rewards,
            "first5": round(statistics.mean(rewards[:5]), 3),
            "last5": round(statistics.mean(rewards[-5:]), 3),
            "seconds_per_step": round(statistics.median(seconds), 3),
        }
    )


def learning(args: argparse.Namespace) -> None:
    settings = vars(args)
    runs = [
        in_child(_learning_worker, policy, asked, settings)
        for asked in ("early", "late")
        for policy in POLICIES
    ]
    emit(
        {
            "workload": "kv-cache-learning",
            "task": f"kv-retrieval, {args.records[0]}..{args.records[1]} records",
            "cache_length": args.cache_length,
            "steps": args.steps,
            "prompts_x_group": f"{args.prompts}x8",
            "runs": runs,
        }
    )
    if args.plot:
        _plot(runs, args)


def _plot(runs: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, asked in zip(axes, ("early", "late")):
        for run in (r for r in runs if r["asked"] == asked):
            curve = run["rewards"]
            smooth = [statistics.mean(curve[max(0, i - 4) : i + 1]) for i in range(len(curve))]
            ax.plot(smooth, label=run["policy"])
        ax.set_title(f"key asked {asked} (5-step mean)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    axes[0].legend()
    fig.suptitle(
        f"kv-retrieval {args.records[0]}..{args.records[1]} records, "
        f"cache {args.cache_length} slots, tiny Qwen2, seed 0"
    )
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-length", type=int, default=128)
    parser.add_argument("--multiples", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--records", type=int, nargs=2, default=[40, 80])
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    if args.learning:
        args.new_tokens = 1 if args.new_tokens == 8 else args.new_tokens  # the reward reads one
        learning(args)
    else:
        memory(args)


if __name__ == "__main__":
    main()
