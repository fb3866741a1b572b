"""The `reward_hacking` guard's calibration: false positives on healthy runs, onset-to-WARN in
the drill, its per-step cost, and a replay of a recorded real-model run.

    .venv/bin/python bench/reward_hacking.py --part fp [--seeds 0 1 2] [--steps 300]
    .venv/bin/python bench/reward_hacking.py --part drill [--seeds 0 1 2 3 4]
    .venv/bin/python bench/reward_hacking.py --part cost [--steps 40]
    .venv/bin/python bench/reward_hacking.py --part w4 --store var/w4-learn/grpod.sqlite

- fp: W1c (`copy`, 16 prompts x 8, 4 new tokens, lr 1e-3) for `--steps` steps per seed under
  the default guards, audited by its own goal (`first_token_reward`); then the same with
  `kl_beta = 0.04` (KL computed, for the KL rule); then W1c audited by the strict
  `exact_match_reward` (W1c's reward reads the first token only: the strict audit reads its
  trailing tokens as a loophole). Counts the steps with a `reward_hacking` finding per rule.
- drill: `run_drill("reward-hacking")` per seed: onset, first WARN, the steps between, the
  audit at WARN, findings on the honest twin.
- cost: W1 (`arith`, the defaults) steps; the guard's `after` and the report's
  `completion_stats` timed per step (median, p99, microseconds).
- w4: a recorded run's steps and evals (read-only) through the guard at its defaults, with
  the example's weights (correct 1.0, number_only 0.25).

Each part prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import time
from types import SimpleNamespace

import torch

from grpod.engine import Engine, EngineConfig, StepReport
from grpod.engine.data.audit import completion_stats
from grpod.engine.grpo.step import decide_step
from grpod.guards import GuardPolicy, run_drill
from grpod.guards.config import RewardHackingConfig
from grpod.guards.hack_drill import AUDIT_EXACT, AUDIT_FIRST_TOKEN
from grpod.guards.reward_hacking import RewardHackingGuard

W1C = dict(task="copy", prompts_per_step=16, group_size=8, max_new_tokens=4, threads=1)
FP_RUNS = {
    "w1c": {**W1C, "audit_rewards": [AUDIT_FIRST_TOKEN]},
    "w1c-kl": {**W1C, "audit_rewards": [AUDIT_FIRST_TOKEN], "kl_beta": 0.04},
    "w1c-exact-audit": {**W1C, "audit_rewards": [AUDIT_EXACT]},
}


def fp(seeds: list[int], steps: int) -> None:
    for name, cfg in FP_RUNS.items():
        for seed in seeds if name != "w1c-exact-audit" else seeds[:1]:
            engine = Engine(EngineConfig.model_validate({**cfg, "seed": seed}))
            policy = GuardPolicy()
            rules: dict[str, int] = {}
            first: dict[str, int] = {}
            rewards = []
            started = time.perf_counter()
            for _ in range(steps):
                result = decide_step(engine, policy, engine.rollout())
                rewards.append(result.report.reward_mean)
                for f in result.verdict.by("reward_hacking"):
                    rules[f.kind] = rules.get(f.kind, 0) + 1
                    first.setdefault(f.kind, result.step)
            print(json.dumps({
                "part": "fp", "run": name, "seed": seed, "steps": steps,
                "steps_with_findings": rules, "first_step": first,
                "reward_first10": round(sum(rewards[:10]) / 10, 3),
                "reward_last10": round(sum(rewards[-10:]) / 10, 3),
                "seconds": round(time.perf_counter() - started, 1),
            }), flush=True)  # fmt: skip


def drill(seeds: list[int]) -> None:
    for seed in seeds:
        r = run_drill("reward-hacking", seed=seed)
        keys = ("seed", "ok", "onset_step", "first_warn_step", "steps_to_warn", "audit_at_onset")
        out = {k: r[k] for k in keys}
        out.update(
            audit_at_warn=r["audit_at_warn"],
            trained_at_warn=r["trained_at_warn"],
            honest_false_positives=r["false_positives"],
            honest_reward_first5=round(sum(r["honest_trained"][:5]) / 5, 3),
            honest_reward_last5=round(sum(r["honest_trained"][-5:]) / 5, 3),
            seconds=r["seconds"],
        )
        print(json.dumps({"part": "drill", **out}), flush=True)


def cost(steps: int) -> None:
    engine = Engine(EngineConfig(threads=1))  # W1: arith, 16 x 8, 4 new tokens
    guard = RewardHackingGuard(RewardHackingConfig())
    guard_us, stats_us = [], []
    for _ in range(steps):
        batch = engine.rollout()
        report = engine.accumulate(batch)
        engine.apply()
        t = time.perf_counter()
        guard.after(batch, report)
        guard_us.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        completion_stats(batch)
        stats_us.append((time.perf_counter() - t) * 1e6)
    for name, values in (("guard_after", guard_us[16:]), ("completion_stats", stats_us)):
        values = sorted(values)
        print(json.dumps({
            "part": "cost", "what": name, "steps": len(values),
            "median_us": round(statistics.median(values)),
            "p99_us": round(values[int(0.99 * (len(values) - 1))]),
        }), flush=True)  # fmt: skip


def w4(store: str) -> None:
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    rows = con.execute("select report_json from steps order by step")
    reports = [StepReport.from_dict(json.loads(r)) for (r,) in rows]
    evals = {s: json.loads(r) for s, r in con.execute("select step, rewards_json from evals")}
    guard = RewardHackingGuard(RewardHackingConfig())
    guard.weights = {"rewards:correct": 1.0, "rewards:number_only": 0.25}
    empty = SimpleNamespace(
        function_rewards={}, num_samples=0, rewards=torch.zeros(0), audit_rewards={}
    )
    found: dict[str, int] = {}
    for report in reports:
        for f in guard.after(empty, report):
            found[f.kind] = found.get(f.kind, 0) + 1
        if report.step + 1 in evals:  # an eval at step k follows step k - 1
            guard.observe_eval(report.step + 1, evals[report.step + 1])
    print(json.dumps({"part": "w4", "steps": len(reports), "evals": len(evals),
                      "steps_with_findings": found}), flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("fp", "drill", "cost", "w4"), required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int)
    p.add_argument("--store", default="var/w4-learn/grpod.sqlite")
    a = p.parse_args()
    if a.part == "fp":
        fp(a.seeds, a.steps or 300)
    elif a.part == "drill":
        drill(a.seeds)
    elif a.part == "cost":
        cost(a.steps or 40)
    else:
        w4(a.store)


if __name__ == "__main__":
    main()
