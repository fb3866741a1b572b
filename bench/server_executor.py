"""The vLLM server grpod starts, two ways side by side on the CPU: its executor
(`--compare executor`, the default) or its weight push (`--compare push`); or what the
whole weight-sync check costs a step (`--compare check-cost`).

`--compare executor`: the model in the engine core's process (`uni`, grpod's default there)
against a worker process of its own (`mp`, vLLM's CPU default).

vLLM's multiprocess executor hands each step to its worker through a shared-memory queue
whose reader busy-waits (sched_yield in a loop) for 1 s after every read before it sleeps
(`SpinCondition`, vllm/distributed/device_communicators/shm_broadcast.py). On 2 cores shared
with the trainer that second stalls the trainer's 2-thread ops: on W4 the trainer's 16-token
scoring forward right after a server request took 1.07 s against 0.09 s, and 0.09-0.14 s with
the worker stopped (SIGSTOP). grpod's server on a CPU now runs `--distributed-executor-backend
uni` with VLLM_ENABLE_V1_MULTIPROCESSING=0 (rollout_server.server_argv, vllm_server.server_env);
`mp` is the same server with `vllm_server_args = ["--distributed-executor-backend", "mp"]`.

`--compare push`: `vllm_server_push = "shared-memory"` (grpod's default for its own server:
the trainer's tensors copied into one shared region the server loads in place,
engine/rollout/shared_weights.py) against `"snapshot"` (a safetensors file in /dev/shm that
the server reloads).

`--compare malloc`: the server's glibc malloc keeping what it frees (`vllm_server_cpu_malloc =
"retain"`, grpod's default on a CPU: mmap and trimming off, so a push's reload reuses the
memory the last one freed) against glibc's defaults (`"glibc"`).

`--compare adopt`: the rollout model's parameters moved into the push's shared region at the
first push (`SharedWeights.adopt`, grpod's default when the sync directory is in memory: a
push copies none of them) against a copy of every parameter into the region at every push
(the adoption patched off in that side's process).

`--compare rollout-check-cost`: one server; each round (`--pairs` of them) samples one step's
prompts three times at unchanged weights (pushed again, untimed, before each), in rotating
order: without the check; with it as an on-policy FP32 step runs it by default
(`weight_sync_on_rollout`: vLLM's two probe requests and the cache half's comparison, the
weights compared on the rollout in the training forward at no further cost); and with the
trainer scoring the probe (its forward run cold here: an upper bound on what it adds to a
step). `--pin`: the server on one core and the trainer on the other, one thread each, so the
probe's forward runs while the server samples (`--no-beside`: after the rollout, as on
shared cores).

`--compare check-cost`: one process, one server, its steps alternating (ABBA) between the
check as it is and no check (`Sampling._sample` patched: the rollout's requests without the
probe's, no trainer forward, no comparison, a passing check in its place). The median of
each pair's step difference is what the whole check costs a step: vLLM's side of it (which
no phase times: it rides in the rollout's requests) and the trainer's, whose `sync_check`
phase alone does not say it (its forward runs just before the training pass and warms what
that pass reads).

Each round runs both sides, one after the other, each in a process of its own (two servers
at once would spin into each other), in alternating order; a side steps rollout -> accumulate ->
apply under every guard (`decide_step`, the default `GuardPolicy`) on the vLLM server and
reports its step's median and its phases' medians (`sync`: the push; `sync_check`: the trainer's
side of the weight-sync check).

    .venv/bin/python bench/server_executor.py
        [--compare executor|push|malloc|adopt|check-cost|rollout-check-cost]
        [--workload W1|W2|W4] [--steps 12] [--rounds 1] [--pairs 100] [--pin] [--no-beside]

Prints one JSON line (also appended to bench/out/results.jsonl).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/server_executor.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import (  # noqa: E402
    SERVER_CPU,
    TRAINER_CPU,
    bootstrap_ci95,
    emit,
    pin_process,
    set_threads,
    workload_config,
)

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVER = {"rollout_backend": "vllm-server", "vllm_server_python": str(VLLM_PYTHON)}
WARMUP = 3
COPY_EVERY_PUSH = "copy_every_push"  # --compare adopt: the parameters copied at every push
# each comparison's two sides: the engine overrides that make them (the first is the default)
SIDES = {
    "executor": {"uni": {}, "mp": {"vllm_server_args": ["--distributed-executor-backend", "mp"]}},
    "push": {
        "shared-memory": {"vllm_server_push": "shared-memory"},
        "snapshot": {"vllm_server_push": "snapshot"},
    },
    "malloc": {"retain": {}, "glibc": {"vllm_server_cpu_malloc": "glibc"}},
    # not a setting: the bench turns the adoption off in that side's process
    "adopt": {"adopted": {}, "copied": {COPY_EVERY_PUSH: True}},
}


def side(workload: str, overrides: dict, steps: int, out: mp.Queue) -> None:
    """One side's run: `steps` timed steps after WARMUP, their medians put on `out`."""
    set_threads()
    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.guards import GuardPolicy

    if overrides.pop(COPY_EVERY_PUSH, False):
        from grpod.engine.rollout.shared_weights import SharedWeights

        SharedWeights.adopt = lambda self, model: False  # type: ignore[method-assign]
    engine = Engine(workload_config(workload, **SERVER, **overrides))
    policy = GuardPolicy()
    times: list[float] = []
    phases: dict[str, list[float]] = {}
    try:
        for i in range(WARMUP + steps):
            started = time.perf_counter()
            result = decide_step(engine, policy, engine.rollout())
            if i >= WARMUP:
                times.append(time.perf_counter() - started)
                for name, seconds in result.phase_seconds.items():
                    phases.setdefault(name, []).append(seconds)
    finally:
        engine.close()
    out.put(
        {
            "step_s": times,
            "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        }
    )


def check_cost(workload: str, pairs: int, out: mp.Queue) -> None:
    """`pairs` pairs of steps after WARMUP, one with the whole check and one without (in ABBA
    order); each side's step seconds and phase seconds on `out`."""
    set_threads()
    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.engine.rollout.sampling import Sampling
    from grpod.engine.weight_sync import WeightSyncCheck
    from grpod.guards import GuardPolicy

    sample = Sampling._sample
    skip = [False]

    def maybe_checked(self, prompts, seed, temperature, probe=True, on_rollout=False):
        if not skip[0] or self.vllm is None or not probe:
            return sample(self, prompts, seed, temperature, probe, on_rollout)
        rollout = sample(self, prompts, seed, temperature, probe=False)  # no probe requests
        version, dtype = self.weight_version(), self.config.dtype
        self.weight_sync = WeightSyncCheck(version, 0.0, 0, 0, 0, dtype)  # a passing check
        return rollout

    Sampling._sample = maybe_checked
    engine = Engine(workload_config(workload, **SERVER))
    policy = GuardPolicy()
    with_check, without = [], []
    phases: dict[str, dict[str, list[float]]] = {"with": {}, "without": {}}
    try:
        for _ in range(WARMUP):
            decide_step(engine, policy, engine.rollout())
        for pair in range(pairs):
            for skipped in (False, True) if pair % 2 == 0 else (True, False):
                skip[0] = skipped
                started = time.perf_counter()
                result = decide_step(engine, policy, engine.rollout())
                (without if skipped else with_check).append(time.perf_counter() - started)
                side = phases["without" if skipped else "with"]
                for name, seconds in result.phase_seconds.items():
                    side.setdefault(name, []).append(seconds)
    finally:
        engine.close()
    out.put({"with": with_check, "without": without, "phases": phases})


ROUTES = ("without", "rollout", "probe")  # rollout-check-cost's three sides


def rollout_check_cost(workload: str, pairs: int, pin: bool, beside: bool, out: mp.Queue) -> None:
    """`pairs` rounds of rollouts after WARMUP steps, each round one step's prompts and seed
    sampled three times at unchanged weights (pushed again before each, untimed): without
    the check; with it as an on-policy FP32 step runs it (the probe's two requests and the
    cache half's comparison: the weights are compared on the rollout in the training
    forward, which costs nothing more); and with the trainer scoring the probe (its forward's
    seconds too). The order rotates every round and reverses every third; each side's
    seconds on `out`. `pin`: the server on one core, the trainer on the other, one thread
    each (then the probe's forward runs while the server samples, unless not `beside`)."""
    set_threads()
    import torch

    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.engine.grpo.trainer import step_seed
    from grpod.engine.rollout.sampling import Sampling
    from grpod.guards import GuardPolicy

    score = Sampling._score_probe
    trainer_side: list[float] = []  # the probe's trainer forward, wherever it ran

    def timed_score(self):
        started = time.perf_counter()
        try:
            return score(self)
        finally:
            trainer_side.append(time.perf_counter() - started)

    Sampling._score_probe = timed_score
    if not beside:
        Sampling._check_beside = lambda self: False
    extra: dict = {}
    if pin:  # the server grpod starts inherits core 1; its OpenMP threads bind there too
        extra["threads"] = 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(SERVER_CPU)
        os.environ["OMP_NUM_THREADS"] = "1"
        pin_process({SERVER_CPU})
    engine = Engine(workload_config(workload, **SERVER, **extra))
    cfg, sampling = engine.config, engine.sampling
    if pin:  # the trainer on core 0 alone, one thread
        engine.start_sampler()
        pin_process({TRAINER_CPU})
        torch.set_num_threads(1)
    seconds: dict[str, list[float]] = {route: [] for route in ROUTES}
    try:
        for _ in range(WARMUP):
            decide_step(engine, GuardPolicy(), engine.rollout())
        trainer_side.clear()  # the warm-up steps' own checks
        for round_ in range(pairs):
            step = engine.step + round_  # a new step's prompts every round
            _, _, prompt_ids = engine._step_prompts(step)
            prompts = [ids for ids in prompt_ids for _ in range(cfg.group_size)]
            seed = step_seed(cfg.seed, step // cfg.epochs)
            order = ROUTES[round_ % 3 :] + ROUTES[: round_ % 3]
            for route in order if (round_ // 3) % 2 == 0 else order[::-1]:
                sampling._push_to_sampler(step)
                started = time.perf_counter()
                checked, on_rollout = route != "without", route == "rollout"
                sampling._sample(prompts, seed, None, probe=checked, on_rollout=on_rollout)
                seconds[route].append(time.perf_counter() - started)
    finally:
        engine.close()
    out.put({**seconds, "forward": trainer_side})


def in_a_process(target: Callable[..., None], *args: Any) -> dict:
    """What `target(*args, out)` puts on `out`, run in a spawned process of its own."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    got = out.get()
    proc.join()
    return got


def rollout_check_cost_report(workload: str, pairs: int, pin: bool, beside: bool) -> dict:
    got = in_a_process(rollout_check_cost, workload, pairs, pin, beside)
    report = {
        "bench": "server_rollout_check_cost",
        "workload": workload,
        "rounds": pairs,
        "pinned": pin,
        "probe_forward_beside_rollout": beside,
        "rollout_without_median_s": round(statistics.median(got["without"]), 4),
    }
    for route in ROUTES[1:]:  # each route's cost: its rollout minus the round's without
        differences = [a - b for a, b in zip(got[route], got["without"])]
        low, high = bootstrap_ci95(differences, statistics.median)
        report[f"rollout_with_{route}_check_median_s"] = round(statistics.median(got[route]), 4)
        report[f"{route}_check_cost_median_s"] = round(statistics.median(differences), 5)
        report[f"{route}_check_cost_ci95_s"] = [round(low, 5), round(high, 5)]
    paired = [a - b for a, b in zip(got["probe"], got["rollout"])]
    report["probe_over_rollout_check_median_s"] = round(statistics.median(paired), 5)
    report["probe_trainer_forward_median_s"] = round(statistics.median(got["forward"]), 5)
    return report


def check_cost_report(workload: str, pairs: int) -> dict:
    got = in_a_process(check_cost, workload, pairs)
    differences = [a - b for a, b in zip(got["with"], got["without"])]
    step = statistics.median(got["without"])
    low, high = bootstrap_ci95(differences, statistics.median)
    check = statistics.median(got["phases"]["with"]["sync_check"])
    return {
        "bench": "server_check_cost",
        "workload": workload,
        "pairs": pairs,
        "step_without_median_s": round(step, 4),
        "step_with_median_s": round(statistics.median(got["with"]), 4),
        "check_cost_median_s": round(statistics.median(differences), 5),
        "check_cost_ci95_s": [round(low, 5), round(high, 5)],
        "check_cost_fraction": round(statistics.median(differences) / step, 4),
        "sync_check_median_s": round(check, 5),
        "sync_check_fraction": round(check / step, 4),
        "phases_median_s": {
            side: {name: round(statistics.median(v), 5) for name, v in phases.items()}
            for side, phases in got["phases"].items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--compare",
        choices=[*sorted(SIDES), "check-cost", "rollout-check-cost"],
        default="executor",
    )
    parser.add_argument("--pairs", type=int, default=100, help="check-cost: pairs of steps")
    parser.add_argument("--workload", choices=("W1", "W2", "W4"), default="W1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--pin", action="store_true", help="rollout-check-cost: server and trainer a core each"
    )
    parser.add_argument(
        "--no-beside",
        action="store_true",
        help="rollout-check-cost: the check's forward after the rollout, even where it could "
        "run beside it",
    )
    args = parser.parse_args()
    if args.compare == "check-cost":
        emit(check_cost_report(args.workload, args.pairs))
        return
    if args.compare == "rollout-check-cost":
        emit(rollout_check_cost_report(args.workload, args.pairs, args.pin, not args.no_beside))
        return
    ctx = mp.get_context("spawn")
    first, second = SIDES[args.compare]
    runs: dict[str, list[dict]] = {first: [], second: []}
    for round_ in range(args.rounds):
        for name in (first, second) if round_ % 2 == 0 else (second, first):
            out = ctx.Queue()
            overrides = SIDES[args.compare][name]
            proc = ctx.Process(target=side, args=(args.workload, overrides, args.steps, out))
            proc.start()
            runs[name].append(out.get())
            proc.join()
    sides = {}
    for name, results in runs.items():
        steps = [t for r in results for t in r["step_s"]]
        median = statistics.median(steps)
        check = statistics.median(r["phases_median_s"].get("sync_check", 0.0) for r in results)
        push = statistics.median(r["phases_median_s"].get("sync", 0.0) for r in results)
        sides[name] = {
            "step_median_s": round(median, 4),
            "check_s": round(check, 4),
            "check_fraction": round(check / median, 4),
            "push_s": round(push, 4),
            "push_fraction": round(push / median, 4),
            "phases_median_s": {
                k: round(statistics.median(r["phases_median_s"].get(k, 0.0) for r in results), 4)
                for k in results[0]["phases_median_s"]
            },
        }
    emit(
        {
            "bench": "server_executor" if args.compare == "executor" else f"server_{args.compare}",
            "workload": args.workload,
            "steps": args.steps,
            "rounds": args.rounds,
            "sides": sides,
            f"{second}_over_{first}_step": round(
                sides[second]["step_median_s"] / sides[first]["step_median_s"], 3
            ),
            f"{second}_over_{first}_push": round(
                sides[second]["push_s"] / max(sides[first]["push_s"], 1e-9), 3
            ),
        }
    )


if __name__ == "__main__":
    main()
