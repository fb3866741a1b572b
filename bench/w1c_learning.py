"""W1c `tiny-copy`: steps and wall seconds to a 5-step mean reward of 0.8 and 0.9, both sides.

    .venv/bin/python bench/w1c_learning.py [--steps 300] [--seeds 0 1 2] [--png PATH]

grpod and TRL run interleaved step by step in one invocation with the same hyperparameters
(constant lr 1e-3), until both reach 0.9 (or `--steps`; `--full` runs them all). Wall seconds
are each side's own step time summed up to the step that first reaches the threshold (the
lock-step waits are not counted). With several `--seeds` (the run seed of both sides: the
sampler's stream and the prompt order; initial weights stay torch seed 0) the pairs run one
after another and the JSON adds, per side, the median over seeds of the steps and wall
seconds to each threshold and the median of the per-seed ratios (see `median_over_seeds`).
Prints one JSON line and writes a PNG of both reward curves (every seed; the first solid).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import GRPOD_MATCHES_TRL, OUT_DIR, TRL_CHANGED, emit, run_interleaved, summarise

THRESHOLDS = (0.8, 0.9)
WINDOW = 5


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last `window` values at each step (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def first_reach(trace: dict, threshold: float) -> dict[str, float | None]:
    """1-based step at which the 5-step mean first reaches `threshold`, and seconds so far."""
    means = running_mean(trace["reward"])
    for i, value in enumerate(means):
        if i + 1 >= WINDOW and value >= threshold:
            return {"step": i + 1, "wall_s": round(sum(trace["seconds"][: i + 1]), 2)}
    return {"step": None, "wall_s": None}


def plot(traces: list[dict], path: Path, dpi: int = 100) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=dpi)
    for name, color in (("grpod", "tab:blue"), ("trl", "tab:orange")):
        label = "grpod" if name == "grpod" else "TRL GRPOTrainer"
        for k, trace in enumerate(traces):
            means = running_mean(trace[name]["reward"])
            steps = range(1, len(means) + 1)
            if k == 0:
                ax.plot(steps, means, color=color, label=f"{label} (5-step mean)")
            else:
                ax.plot(steps, means, color=color, alpha=0.3, linewidth=0.8)
    for threshold in THRESHOLDS:
        ax.axhline(threshold, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    seeds = f" ({len(traces)} seeds, the first solid)" if len(traces) > 1 else ""
    ax.set_title(f"W1c tiny-copy: grpod vs TRL, same settings{seeds}", fontsize=10)
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def side_summary(t: dict) -> dict:
    return {
        **{f"reach_{x}": first_reach(t, x) for x in THRESHOLDS},
        "total_wall_s": round(sum(t["seconds"]), 2),
        **summarise(t),
    }


def reach_ratios(sides: dict) -> dict[str, float]:
    ratios = {}
    for x in THRESHOLDS:
        g, t = sides["grpod"][f"reach_{x}"], sides["trl"][f"reach_{x}"]
        if g["step"] and t["step"]:
            ratios[f"steps_to_{x}_grpod_over_trl"] = round(g["step"] / t["step"], 2)
            ratios[f"wall_to_{x}_trl_over_grpod"] = round(t["wall_s"] / g["wall_s"], 2)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--png", type=Path, default=OUT_DIR / "w1c_curves.png")
    parser.add_argument(
        "--full", action="store_true", help="run every step, not only until both reach 0.9"
    )
    args = parser.parse_args()

    def both_reached(trace: dict) -> bool:
        return not args.full and all(
            first_reach(t, THRESHOLDS[-1])["step"] is not None for t in trace.values()
        )

    traces, runs = [], []
    for seed in args.seeds:
        trace = run_interleaved("copy", args.steps, stop=both_reached, seed=seed)
        traces.append(trace)
        sides = {name: side_summary(t) for name, t in trace.items()}
        runs.append(
            {
                "seed": seed,
                "steps_run": len(trace["grpod"]["reward"]),
                "same_initial_weights": trace["grpod"]["weights"] == trace["trl"]["weights"],
                **sides,
                **reach_ratios(sides),
                "ratio_completions_per_s": round(
                    sides["grpod"]["completions_per_s"] / sides["trl"]["completions_per_s"], 2
                ),
            }
        )
    plot(traces, args.png)
    record = {"workload": "W1c", "steps": args.steps, **runs[0]}
    if len(runs) > 1:
        record["seeds"] = runs
        record["median_over_seeds"] = median_over_seeds(runs, args.steps)
    emit(
        {
            **record,
            "png": str(args.png),
            "trl_changed": sorted(TRL_CHANGED),
            "grpod_changed": GRPOD_MATCHES_TRL,
        }
    )


def median_over_seeds(runs: list[dict], steps: int) -> dict:
    """Per side and threshold, the median over seeds of the steps to reach it (a seed that
    never does counts as `steps`), and the median of the per-seed ratios: steps grpod / TRL
    and wall seconds TRL / grpod, each measured within one interleaved run (a side that
    did not reach the threshold contributes its steps / wall seconds run, a bound)."""
    out: dict = {}
    for x in THRESHOLDS:
        key = f"reach_{x}"
        for name in ("grpod", "trl"):
            reach = [run[name][key] for run in runs]
            out[f"{name}_steps_to_{x}"] = statistics.median(r["step"] or steps for r in reach)
            out[f"{name}_seeds_reaching_{x}"] = sum(r["step"] is not None for r in reach)
        step_ratios, wall_ratios = [], []
        for run in runs:
            g, t = (run[name][key] for name in ("grpod", "trl"))
            g_step, t_step = g["step"] or run["steps_run"], t["step"] or run["steps_run"]
            g_wall = g["wall_s"] if g["step"] else run["grpod"]["total_wall_s"]
            t_wall = t["wall_s"] if t["step"] else run["trl"]["total_wall_s"]
            step_ratios.append(g_step / t_step)
            wall_ratios.append(t_wall / g_wall)
        out[f"steps_to_{x}_grpod_over_trl"] = round(statistics.median(step_ratios), 2)
        out[f"wall_to_{x}_trl_over_grpod"] = round(statistics.median(wall_ratios), 2)
    return out


if __name__ == "__main__":
    main()
