"""W1 `tiny-arith`: plain TRL GRPOTrainer against grpod.integrations.trl's GuardedGRPOTrainer,
interleaved step by step in one run (the same initial weights, prompts, reward and seed).

    .venv/bin/python bench/trl_guarded.py [--steps 40]

Prints one JSON line: per side median s/step over steps 3..N, peak RSS; the guarded / plain
ratio of the median step time (the goal: <= 1.03 with every guard and the recorder on), and
the median and bootstrap 95% interval of the paired per-step ratios (each step k of both
sides ran back to back).
"""

from __future__ import annotations

import argparse
import statistics

from common import _trl_worker as trl_worker
from common import bootstrap_ci95, emit, run_lockstep, summarise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    trace = run_lockstep(
        {
            "trl": (trl_worker, ("arith", args.steps, 0, False), {}),
            "guarded": (trl_worker, ("arith", args.steps, 0, True), {}),
        },
        args.steps,
    )
    sides = {name: summarise(t) for name, t in trace.items()}
    plain, guarded = sides["trl"], sides["guarded"]
    paired = [g / t for g, t in zip(trace["guarded"]["seconds"][2:], trace["trl"]["seconds"][2:])]
    grpod_s = statistics.median(p.get("grpod_s", 0.0) for p in trace["guarded"]["phases"][2:])
    emit(
        {
            "workload": "W1",
            "steps": args.steps,
            "same_initial_weights": trace["trl"]["weights"] == trace["guarded"]["weights"],
            "trl": plain,
            "guarded_trl": guarded,
            "ratio_median_s_per_step": round(
                guarded["median_s_per_step"] / plain["median_s_per_step"], 4
            ),
            "paired_ratio_median": round(statistics.median(paired), 4),
            "paired_ratio_mean_ci95": [round(x, 4) for x in bootstrap_ci95(paired)],
            # measured inside the guarded process, so less exposed to the shared machine: the
            # integration's seconds per step (batch, report, guards, record, metrics; not the
            # optimizer's own step) as a fraction of that side's median step
            "grpod_s_per_step_median": round(grpod_s, 5),
            "grpod_fraction_of_step": round(grpod_s / guarded["median_s_per_step"], 4),
            "goal_ratio_max": 1.03,
        }
    )


if __name__ == "__main__":
    main()
