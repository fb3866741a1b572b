"""Async steps (`max_staleness`, engine/rollout/ahead.py): what they buy a second, cost a step.

Two parts, each one invocation with its sides interleaved step by step (`run_lockstep`):

- `--part throughput` (`.venv-vllm`: a real vLLM): W1 (and with `--workload W2` the
  long-prompt workload) steps per second for the torch sampler, colocated vLLM and the
  vllm-server at `max_staleness` 0, 1 and 2, every step under every guard (`decide_step`
  with the default `GuardPolicy`). A step's time includes waiting, at its end, for the
  rollout it launched: a side's background sampling never runs on another side's time.
  Colocated vLLM and the torch sampler sample at launch whatever `max_staleness` is (no
  overlap), so they run at 0 only. `trl`: TRL's GRPOTrainer on the same task with its
  default generation, in `.venv` (TRL 1.16's vLLM server mode needs vllm <= 0.31); at W2 on
  grpod's per-step prompts in step order (`common.w2_trl_task`).
- `--part learning` (`.venv`): W1c (`copy`, constant lr 1e-3, the torch sampler) at
  `max_staleness` 0, 1 and 2 for each of `--seeds`: steps and wall seconds to a 5-step mean
  reward of 0.8 and 0.9. Every side runs with `tis_cap = 2` (required above 0) so that the
  staleness is the only difference. Staleness is the same quantity whatever the backend
  (the torch sampler samples each rollout at its launch version), so these are the learning
  figures of the server's async steps too.

    .venv-vllm/bin/python bench/async_steps.py --part throughput [--steps 30] [--workload W1]
        [--pin]  (W1, W2 or W4; --pin: each server side's server and trainer on a core each)
        [--sides torch,vllm,vllm-server-k0,vllm-server-k1,vllm-server-k2,trl]
    .venv/bin/python bench/async_steps.py --part learning [--steps 300] [--seeds 0 1 2]

Prints one JSON line (also appended to bench/out/results.jsonl).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/async_steps.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import (  # noqa: E402
    SERVER_CPU,
    TRAINER_CPU,
    _grpod_worker,
    _trl_worker,
    emit,
    peak_rss_mib,
    pin_process,
    run_lockstep,
    set_threads,
    workload_config,
)
from w1c_learning import THRESHOLDS, first_reach  # noqa: E402

TIS = {"tis_cap": 2.0}


def throughput_worker(conn, backend: str, staleness: int, workload: str, pin: bool = False) -> None:
    set_threads()
    import torch

    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.guards import GuardPolicy

    extra: dict = {}
    pinned = pin and backend == "vllm-server"
    if pinned:  # the server grpod starts inherits core 1; its OpenMP threads bind there too
        extra["threads"] = 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(SERVER_CPU)
        os.environ["OMP_NUM_THREADS"] = "1"  # one core each: no spinning second thread
        pin_process({SERVER_CPU})
    engine = Engine(
        workload_config(workload, rollout_backend=backend, max_staleness=staleness, **TIS, **extra)
    )
    policy = GuardPolicy()
    engine.start_sampler()  # vLLM starts before the first step: not a step of the benchmark
    if pinned:  # the trainer on core 0 alone, one thread
        pin_process({TRAINER_CPU})
        torch.set_num_threads(1)
    engine.take_phase_seconds()
    conn.send(("ready", f"{backend}-k{staleness}"))
    while conn.recv() == "go":
        started = time.perf_counter()
        batch = engine.rollout()
        result = decide_step(engine, policy, batch)
        engine.sampling.drain()  # the rollout this step launched: on this side's time
        seconds = time.perf_counter() - started
        stats = engine.take_ahead_stats()
        phases = {
            **result.phase_seconds,
            "overlap": stats.overlap_seconds if stats else 0.0,
            "staleness": float(batch.staleness or 0),
        }
        tokens = int(batch.completion_lengths.sum())
        conn.send(("step", seconds, result.report.reward_mean, tokens, phases))
    engine.close()
    conn.send(("done", peak_rss_mib(), None))


def throughput(args: argparse.Namespace) -> dict:
    sides = {"torch": ("torch", 0), "vllm": ("vllm", 0)}
    for k in (0, 1, 2):
        sides[f"vllm-server-k{k}"] = ("vllm-server", k)
    wanted = args.sides.split(",") if args.sides else [*sides, "trl"]
    specs = {
        name: (throughput_worker, (backend, k, args.workload, args.pin), {})
        for name, (backend, k) in sides.items()
        if name in wanted
    }
    if "trl" in wanted:
        # TRL's GRPOTrainer, its default generation: TRL 1.16's vLLM server mode needs
        # vllm <= 0.31 (this vLLM is 0.32), and TRL is not in .venv-vllm: it runs in .venv
        python = ROOT / ".venv" / "bin" / "python"
        task = "arith" if args.workload == "W1" else "kv-retrieval"
        specs["trl"] = (_trl_worker, (task, args.steps + 1), {"BENCH_PYTHON": str(python)})
    trace = run_lockstep(specs, args.steps)
    skip = 3  # the first steps warm caches on every side
    out = {}
    for name, t in trace.items():
        phases = t["phases"][skip:]
        out[name] = {
            "median_s_per_step": round(statistics.median(t["seconds"][skip:]), 5),
            "steps_per_s": round(1 / statistics.median(t["seconds"][skip:]), 3),
            "peak_rss_mib": round(t["peak_rss_mib"], 1),
            "reward_last5": round(statistics.mean(t["reward"][-5:]), 4),
        }
        if name != "trl":  # TRL reports no phases
            out[name]["rollout_wait_s"] = round(statistics.median(p["rollout"] for p in phases), 5)
            out[name]["overlap_s"] = round(statistics.median(p["overlap"] for p in phases), 5)
            out[name]["max_staleness_seen"] = int(max(p["staleness"] for p in t["phases"]))
    ratios = {}
    if "trl" in out:  # every grpod side against TRL's default generation
        for name in out:
            if name != "trl":
                key = f"ratio_steps_per_s_{name}_over_trl".replace("-", "_")
                ratios[key] = round(
                    out["trl"]["median_s_per_step"] / out[name]["median_s_per_step"], 3
                )
    for name in out:
        for other in out:
            if name != other and name.startswith("vllm-server-k") and other != "vllm-server-k2":
                key = f"ratio_steps_per_s_{name}_over_{other}".replace("-", "_")
                ratios[key] = round(
                    out[other]["median_s_per_step"] / out[name]["median_s_per_step"], 3
                )
    return {
        "part": "throughput",
        "workload": args.workload,
        "pinned": args.pin,
        **out,
        **ratios,
    }


def learning(args: argparse.Namespace) -> dict:
    ks = (0, 1, 2)

    def all_reached(trace: dict) -> bool:
        return all(first_reach(t, THRESHOLDS[-1])["step"] is not None for t in trace.values())

    runs = []
    for seed in args.seeds:
        specs = {
            f"k{k}": (_grpod_worker, ("copy", {"seed": seed, "max_staleness": k, **TIS}), {})
            for k in ks
        }
        trace = run_lockstep(specs, args.steps, all_reached)
        runs.append(
            {
                "seed": seed,
                "steps_run": len(trace["k0"]["reward"]),
                **{
                    name: {f"reach_{x}": first_reach(t, x) for x in THRESHOLDS}
                    for name, t in trace.items()
                },
            }
        )
    summary = {}
    for k in ks:
        for x in THRESHOLDS:
            steps = [r[f"k{k}"][f"reach_{x}"]["step"] for r in runs]
            summary[f"k{k}_steps_to_{x}"] = steps
            if k and all(steps) and all(r["k0"][f"reach_{x}"]["step"] for r in runs):
                per_seed = [s / r["k0"][f"reach_{x}"]["step"] for s, r in zip(steps, runs)]
                summary[f"k{k}_over_k0_steps_to_{x}_per_seed"] = [round(v, 3) for v in per_seed]
                summary[f"k{k}_over_k0_steps_to_{x}_median"] = round(statistics.median(per_seed), 3)
    return {"part": "learning", "workload": "W1c", "seeds": args.seeds, "runs": runs, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("throughput", "learning"), required=True)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workload", choices=("W1", "W2", "W4"), default="W1")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="throughput: each vllm-server side's server on core 1, its trainer on core 0",
    )
    parser.add_argument(
        "--sides", default="", help="throughput: e.g. vllm-server-k0,vllm-server-k1 (default all)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.part == "throughput":
        args.steps = args.steps or 30
        record = throughput(args)
    else:
        args.steps = args.steps or 300
        record = learning(args)
    emit({"bench": "async_steps", "steps": args.steps, **record})


if __name__ == "__main__":
    main()
