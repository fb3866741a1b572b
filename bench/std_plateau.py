"""The plateau of `advantage_std` population vs sample on W1c `copy`, over many seeds.

    .venv/bin/python bench/std_plateau.py [--seeds 20] [--steps 400] [--plateau 300]

For each seed (the run seed: sampler stream and prompt order; initial weights stay torch
seed 0) one run per std, constant lr 1e-3, no guards: the plateau is the mean reward of steps
`--plateau`..`--steps`-1. The seeds are paired, so the statistic is the per-seed difference
sample - population, with a percentile-bootstrap 95% interval of its mean. Each run also
reports what the std's scale touches besides the loss scale (Adam absorbs a constant one):
the fraction of steps whose pre-clip grad norm exceeds `max_grad_norm` (clipped), the
PPO clip fractions, the zero-std group fraction and the policy entropy at the plateau.
Prints one JSON line (and appends it to bench/out/results.jsonl).
"""

from __future__ import annotations

import statistics
import time

from common import bootstrap_ci95, emit, engine_config, numeric_options, set_threads

STDS = ("population", "sample")


def run_one(seed: int, std: str, steps: int, plateau: int) -> dict[str, float]:
    from grpod.engine import Engine

    engine = Engine(engine_config("copy", seed=seed, advantage_std=std, threads=1))
    rewards, clipped, ppo_clip, zero_std, entropy = [], [], [], [], []
    started = time.perf_counter()
    for _ in range(steps):
        report = engine.accumulate(engine.rollout())
        engine.apply()
        rewards.append(report.reward_mean)
        clipped.append(report.clip_coef < 1.0)
        ppo_clip.append(report.clip_fraction_low + report.clip_fraction_high)
        zero_std.append(report.zero_std_group_fraction)
        entropy.append(report.entropy if report.entropy is not None else float("nan"))
    tail = slice(plateau, steps)
    return {
        "plateau_reward": statistics.mean(rewards[tail]),
        "first100_reward": statistics.mean(rewards[:100]),
        "grad_clipped_fraction": statistics.mean(clipped),
        "ppo_clip_fraction": statistics.mean(ppo_clip),
        "plateau_zero_std_fraction": statistics.mean(zero_std[tail]),
        "plateau_entropy_nats": statistics.mean(entropy[tail]),
        "wall_s": time.perf_counter() - started,
    }


def main() -> int:
    args = numeric_options(__doc__, seeds=20, first_seed=0, steps=400, plateau=300)
    set_threads()
    runs: dict[str, list[dict]] = {std: [] for std in STDS}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for std in STDS:
            result = run_one(seed, std, args.steps, args.plateau)
            runs[std].append({"seed": seed, **{k: round(v, 4) for k, v in result.items()}})
            print(f"# seed {seed} {std}: {runs[std][-1]}", flush=True)
    diffs = [
        s["plateau_reward"] - p["plateau_reward"]
        for s, p in zip(runs["sample"], runs["population"])
    ]
    low, high = bootstrap_ci95(diffs)
    emit(
        {
            "bench": "std_plateau",
            "task": "copy",
            "seeds": args.seeds,
            "steps": args.steps,
            "plateau_steps": [args.plateau, args.steps - 1],
            "plateau_mean": {
                std: round(statistics.mean(r["plateau_reward"] for r in runs[std]), 4)
                for std in STDS
            },
            "diff_sample_minus_population": round(statistics.mean(diffs), 4),
            "diff_ci95": [round(low, 4), round(high, 4)],
            "seeds_sample_better": sum(d > 0 for d in diffs),
            "runs": runs,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
