"""W1c `copy` over a long run: TRL's logged entropy against grpod's, and when each guard fires.

    .venv/bin/python bench/entropy_long_run.py [--steps 1400] [--seed 0] [--png PATH]

Both sides train the same tiny model (torch seed 0 weights) on `copy` with W1c's settings
(constant lr 1e-3, no KL, 16 prompts x 8 completions, 4 new tokens; grpod with the sample std
as TRL), one after the other, each in its own process. Per step each side records its mean
reward, its mean per-token policy entropy on completion tokens (TRL: its logged `entropy`;
grpod: the report's, from the FP32 chunked head), its zero-std group fraction (TRL:
`frac_reward_zero_std`) and its pre-clip grad norm. Both traces then go through grpod's own
`dead_campaign`, `reward_trend` and `entropy` guards at their defaults (the same classes the
daemon runs), which gives the step each would first have fired on either run: TRL logs these
numbers and does nothing with them. Prints one JSON line (100-step means and the firing steps)
and writes a PNG of both runs' entropy, reward and zero-std fraction with the firing steps
marked.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import (
    GRPOD_MATCHES_TRL,
    ROOT,
    TRL_CHANGED,
    build_hf_tokenizer,
    build_model,
    completion_reward,
    emit,
    engine_config,
    in_child,
    set_threads,
    task_prompts,
    trl_config,
)

FIELDS = ("reward", "entropy", "zero_std", "grad_norm")
GUARDS = ("dead_campaign", "reward_trend", "entropy")
BLOCK = 100  # steps per summary mean


def _grpod_trace(conn, steps: int, seed: int) -> None:
    set_threads()
    from grpod.engine import Engine

    engine = Engine(engine_config("copy", seed=seed, threads=1, **GRPOD_MATCHES_TRL))
    trace: dict[str, list[float]] = {k: [] for k in FIELDS}
    started = time.perf_counter()
    for _ in range(steps):
        report = engine.accumulate(engine.rollout())
        engine.apply()
        trace["reward"].append(report.reward_mean)
        trace["entropy"].append(math.nan if report.entropy is None else report.entropy)
        trace["zero_std"].append(report.zero_std_group_fraction)
        trace["grad_norm"].append(report.grad_norm)
    conn.send({"trace": trace, "wall_s": time.perf_counter() - started})


def _trl_trace(conn, steps: int, seed: int) -> None:
    set_threads()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- TRL prints its log dicts; not ours
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in task_prompts("copy")])
    trace: dict[str, list[float]] = {k: [] for k in FIELDS}

    def reward(prompts, completions, completion_ids, answer, **_) -> list[float]:
        return [completion_reward(ids, a) for ids, a in zip(completion_ids, answer)]

    class Logged(TrainerCallback):
        """Every step's logged metrics (logging_steps = 1: one log per optimizer step)."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "entropy" not in logs:  # the end-of-train summary
                return
            trace["reward"].append(float(logs.get("reward", math.nan)))
            trace["entropy"].append(float(logs["entropy"]))
            trace["zero_std"].append(float(logs.get("frac_reward_zero_std", math.nan)))
            trace["grad_norm"].append(float(logs.get("grad_norm", math.nan)))

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        config = trl_config(steps, out, seed)
        config.logging_steps = 1  # one log, so one trace row, per optimizer step
        trainer = GRPOTrainer(
            model=build_model(),
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=build_hf_tokenizer(),
            callbacks=[Logged()],
        )
        trainer.train()
    conn.send({"trace": trace, "wall_s": time.perf_counter() - started})


def guard_firings(trace: dict[str, list[float]]) -> dict[str, dict | None]:
    """Feed a trace, step by step, to grpod's campaign guards at their default settings;
    each guard's first finding (step and message), None if it never fired."""
    from grpod.guards.campaign import DeadCampaignGuard, RewardTrendGuard
    from grpod.guards.config import GuardsConfig
    from grpod.guards.entropy import EntropyGuard

    config = GuardsConfig()
    guards = [
        DeadCampaignGuard(config.dead_campaign),
        RewardTrendGuard(config.reward_trend),
        EntropyGuard(config.entropy),
    ]
    first: dict[str, dict | None] = {g.name: None for g in guards}
    for step in range(len(trace["reward"])):
        report = SimpleNamespace(
            step=step,
            skipped_compute=False,
            reward_mean=trace["reward"][step],
            entropy=trace["entropy"][step],
            zero_std_group_fraction=trace["zero_std"][step],
            grad_norm=trace["grad_norm"][step],
        )
        for guard in guards:
            findings = guard.after(None, report)
            if findings and first[guard.name] is None:
                f = findings[0]
                first[guard.name] = {"step": step, "action": f.action.name, "message": f.message}
    return first


def block_means(values: list[float]) -> list[float | None]:
    out = []
    for start in range(0, len(values), BLOCK):
        block = [v for v in values[start : start + BLOCK] if math.isfinite(v)]
        out.append(round(sum(block) / len(block), 4) if block else None)
    return out


def plot(traces: dict[str, dict], firings: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {"grpod": "tab:blue", "trl": "tab:orange"}
    styles = {"dead_campaign": "-", "reward_trend": "--", "entropy": ":"}
    for side, trace in traces.items():
        for ax, key, label in zip(
            axes,
            ("entropy", "reward", "zero_std"),
            ("entropy (nats, log)", "mean reward", "zero-std group fraction"),
        ):
            values = trace[key]
            smooth = [
                sum(values[max(0, i - 19) : i + 1]) / len(values[max(0, i - 19) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(smooth, color=colors[side], label=f"{side} (20-step mean)")
            ax.set_ylabel(label)
        for guard, fired in firings[side].items():
            if fired is not None:
                for ax in axes:
                    ax.axvline(fired["step"], color=colors[side], linestyle=styles[guard], lw=1)
    axes[0].set_yscale("log")
    axes[-1].set_xlabel("step")
    handles = axes[0].get_legend_handles_labels()
    extra = [
        plt.Line2D([], [], color="gray", linestyle=s, label=f"{g} fires") for g, s in styles.items()
    ]
    axes[0].legend(handles=handles[0] + extra, fontsize=8, loc="lower left")
    axes[0].set_title("W1c copy, constant lr 1e-3, no KL: grpod vs TRL GRPOTrainer")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "entropy_long_run.png")
    args = parser.parse_args()
    runs = {
        "grpod": in_child(_grpod_trace, args.steps, args.seed),
        "trl": in_child(_trl_trace, args.steps, args.seed),
    }
    traces = {side: run["trace"] for side, run in runs.items()}
    firings = {side: guard_firings(trace) for side, trace in traces.items()}
    plot(traces, firings, args.png)
    emit(
        {
            "workload": "W1c long run",
            "steps": args.steps,
            "seed": args.seed,
            "block_steps": BLOCK,
            **{
                side: {
                    "steps_logged": len(trace["reward"]),
                    "wall_s": round(runs[side]["wall_s"], 1),
                    **{f"{k}_by_block": block_means(trace[k]) for k in FIELDS},
                    "first_fired": firings[side],
                }
                for side, trace in traces.items()
            },
            "png": str(args.png),
            "trl_changed": sorted(TRL_CHANGED),
            "grpod_changed": GRPOD_MATCHES_TRL,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
