"""The vLLM server grpod starts, two ways side by side on the CPU: its executor
(`--compare executor`, the default), its weight push (`--compare push`) or when the trainer
computes its side of the weight-sync check (`--compare check`).

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

`--compare check`: the trainer's logprobs of the probe before the push (`before-push`, grpod's
order since 2026-12-04, `Sampling._push_to_sampler`) against after the rollout (`after-rollout`,
the order before: the side's process runs `check_after_rollout`'s two methods instead).

Each round runs both sides, one after the other, each in a process of its own (two servers
at once would spin into each other), in alternating order; a side steps rollout -> accumulate ->
apply under every guard (`decide_step`, the default `GuardPolicy`) on the vLLM server and
reports its step's median and its phases' medians (`sync`: the push; `sync_check`: the trainer's
side of the weight-sync check).

    .venv/bin/python bench/server_executor.py [--compare executor|push] [--workload W1|W2|W4]
        [--steps 12] [--rounds 1]

Prints one JSON line (also appended to bench/out/results.jsonl).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/server_executor.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import emit, set_threads, workload_config  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WARMUP = 3
# each comparison's two sides: the engine overrides that make them (the first is the default)
SIDES = {
    "executor": {"uni": {}, "mp": {"vllm_server_args": ["--distributed-executor-backend", "mp"]}},
    "push": {
        "shared-memory": {"vllm_server_push": "shared-memory"},
        "snapshot": {"vllm_server_push": "snapshot"},
    },
    "check": {"before-push": {}, "after-rollout": {}},
}
OLD_ORDER = ("check", "after-rollout")  # the one side that changes code, not the config


def check_after_rollout() -> None:
    """The check's order before 2026-12-04: the push alone, then the trainer's forward of the
    probe once the rollout is in, with the comparison (both timed as `sync_check`)."""
    from grpod.engine.rollout.sampling import Sampling

    check = Sampling._check_sampler

    def push_only(self, step):  # _push_to_sampler as it was
        self.start()
        with self.clock.timed("sync"):
            self._unloaded = self.vllm.push(self.rollout_model, self.faults.push(step))

    def forward_then_check(self, scores):
        self._trainer_probe = self._trainer_logprobs()
        return check(self, scores)

    Sampling._push_to_sampler, Sampling._check_sampler = push_only, forward_then_check


def side(workload: str, overrides: dict, steps: int, out: mp.Queue, old_order: bool) -> None:
    """One side's run: `steps` timed steps after WARMUP, their medians put on `out`;
    `old_order`: the check's forward after the rollout (`check_after_rollout`)."""
    set_threads()
    if old_order:
        check_after_rollout()
    from grpod.engine import Engine
    from grpod.engine.grpo.step import decide_step
    from grpod.guards import GuardPolicy

    server = {"rollout_backend": "vllm-server", "vllm_server_python": str(VLLM_PYTHON)}
    engine = Engine(workload_config(workload, **server, **overrides))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(SIDES), default="executor")
    parser.add_argument("--workload", choices=("W1", "W2", "W4"), default="W1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    first, second = SIDES[args.compare]
    runs: dict[str, list[dict]] = {first: [], second: []}
    for round_ in range(args.rounds):
        for name in (first, second) if round_ % 2 == 0 else (second, first):
            out = ctx.Queue()
            overrides = SIDES[args.compare][name]
            old_order = (args.compare, name) == OLD_ORDER
            proc = ctx.Process(
                target=side, args=(args.workload, overrides, args.steps, out, old_order)
            )
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
