"""W4 `real-lm`: grpod's engine against TRL's GRPOTrainer on SmolLM2-135M-Instruct, interleaved.

    make model-smollm2                                   # once: the FP32 model directory
    .venv/bin/python bench/w4_vs_trl.py [--steps 12] [--max-minutes M] [--config FILE]

grpod's engine runs the campaign's `[engine]` as `grpod run` loads it (model, task and reward
modules from the config's directory; no daemon, guards or eval around it); TRL's GRPOTrainer
gets the same FP32 model directory, the same prompts through the same chat template, the
same reward functions and weights, the same batch, completion budget, lr, max_grad_norm and
sampling (`common.toml_trl_changed`). Both sides step alternately in their own processes
at the same thread count (`common.run_interleaved`). Prints one JSON line: per side median
s/step over steps 3..N, completions/s, completion tokens/s, peak RSS, first/last 5-step mean
reward (the weighted total); and the grpod / TRL ratios.
"""

from __future__ import annotations

import argparse
import json
import time

from common import (
    GRPOD_MATCHES_TRL,
    OUT_DIR,
    ROOT,
    THREADS,
    compare,
    emit,
    engine_config,
    run_interleaved,
    toml_trl_changed,
)

CONFIG = ROOT / "examples" / "smollm2-arith" / "grpod.toml"

# what no setting makes equal (bench/README.md, W4)
DIFFERS = [
    "prompt order: grpod's seeded permutation of the task vs TRL's shuffling sampler",
    "sampling: grpod's fused static-cache decoder vs HF generate (own RNG streams)",
    "std: TRL adds 1e-4 to each group's std (grpod: equal-reward groups get 0 exactly)",
    "grpod's engine alone: no daemon, guards, flight recorder or held-out eval (TRL: none)",
    "TRL logs its metrics each step (inside its step time)",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--config", default=str(CONFIG), help="the campaign's grpod.toml")
    parser.add_argument(
        "--idle-gap",
        type=float,
        default=0.0,
        help="seconds of idle machine before every step (default 0: back to back)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop before a step pair would end past this many minutes (0: run every step)",
    )
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the median skips the first 2)")
    return args


def matched(engine) -> dict[str, list]:
    """{setting: [grpod, TRL]} for what both sides are given from the campaign."""
    trl = {k: v for k, (v, _) in toml_trl_changed(engine).items()}
    return {
        "completions_per_step": [
            engine.prompts_per_step * engine.group_size,
            trl["per_device_train_batch_size"],
        ],
        "group_size": [engine.group_size, trl["num_generations"]],
        "max_new_tokens": [engine.max_new_tokens, trl["max_completion_length"]],
        "lr": [engine.lr, trl["learning_rate"]],
        "max_grad_norm": [engine.max_grad_norm, trl["max_grad_norm"]],
        "temperature": [engine.temperature, trl["temperature"]],
        "top_p": [engine.top_p, trl["top_p"]],
        "reward_weights": [list(engine.reward_weights), trl["reward_weights"]],
        "threads": [engine.threads, THREADS],
    }


def main() -> None:
    args = parse_args()
    engine = engine_config(args.config)
    if engine.threads != THREADS:
        raise SystemExit(
            f"{args.config}: threads {engine.threads}, the bench runs TRL at {THREADS}"
        )
    started = time.monotonic()

    def out_of_time(trace: dict) -> bool:  # the next pair would take as long as the last
        last_pair = trace["grpod"]["seconds"][-1] + trace["trl"]["seconds"][-1]
        spent = time.monotonic() - started
        enough = len(trace["grpod"]["seconds"]) >= 3  # the median skips the first 2
        return bool(args.max_minutes) and enough and spent + last_pair > 60 * args.max_minutes

    trace = run_interleaved(
        args.config, args.steps, stop=out_of_time, idle_gap=args.idle_gap, progress_every=1
    )
    steps = len(trace["grpod"]["seconds"])
    OUT_DIR.mkdir(parents=True, exist_ok=True)  # the raw trace too: a W4 run is long
    (OUT_DIR / "w4_trace.json").write_text(json.dumps(trace))
    emit(
        {
            "workload": "W4",
            "config": args.config,
            "steps": steps,
            "steps_asked": args.steps,
            "idle_gap_s": args.idle_gap,
            **compare(trace, completions=engine.prompts_per_step * engine.group_size),
            "reward_per_step": {
                name: [round(r, 4) for r in t["reward"]] for name, t in trace.items()
            },
            "matched": matched(engine),
            "trl_changed": sorted(toml_trl_changed(engine)),
            "grpod_changed": GRPOD_MATCHES_TRL,
            "differs": DIFFERS,
        }
    )


if __name__ == "__main__":
    main()
