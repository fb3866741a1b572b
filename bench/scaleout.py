"""Scale-out on this CPU machine: W1 step time of 2 ranks (torchrun, gloo; FSDP2, then DDP)
vs 1 process on the same global batch (16 prompts x 8), and what the added per-step
collectives cost.

Honestly labelled: CPU/gloo on two shared cores, so 2 ranks x 1 thread compete with
1 process x 2 threads for the same cores; this measures communication and sharding overhead,
not a GPU speed-up. Each side runs `--steps` steps (rollout -> accumulate -> apply) after
`--warmup`, in its own launch, one after the other. The collectives grpod adds per step are
timed apart, in the 2-rank job: the gather of [valid, expected, loss sum] and the max of the
trunk-pass count (`collectives_ms`), and under FSDP2 the rollout copy's all-gather of the
full weights (`rollout_sync_ms`; DDP has no copy). `ratio` = 1-process median step seconds /
2-rank median step seconds, per mode.
Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/scaleout.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/scaleout.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import emit, scaleout_parser  # noqa: E402

W1 = dict(task="arith")  # the embedded W1 setting: 16 prompts x 8 completions, 4 new tokens


def worker(steps: int, warmup: int, parallel: str) -> None:
    import torch

    from grpod.engine import Engine, EngineConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    threads = max(1, 2 // world)  # the same two cores either way
    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = {**W1, "threads": threads, "parallel": parallel if world > 1 else "none"}
        engine = Engine(EngineConfig.model_validate(config))
    seconds = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        engine.accumulate(engine.rollout())
        engine.apply()
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
    out = {"world_size": world, "step_seconds": statistics.median(seconds)}
    if engine.parallel.distributed:
        out["collectives_ms"] = 1e3 * _timed(
            lambda: (engine.parallel.gather([1.0, 2.0, 3.0]), engine.parallel.max_int(1))
        )
    if engine.parallel.sharded:
        out["rollout_sync_ms"] = 1e3 * _timed(
            lambda: engine.parallel.sync_rollout_copy(engine.model, engine.rollout_model)
        )
    if engine.parallel.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if engine.parallel.distributed:
        import torch.distributed as dist

        dist.barrier()
        sys.stdout.flush()
        os._exit(0)  # the gloo teardown abort (tests/guards/dist_worker.py)


def _timed(call, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def launch(command: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    args = scaleout_parser(steps=8, warmup=2).parse_args()
    if args.worker:
        return worker(args.steps, args.warmup, args.parallel)
    me = [str(Path(__file__).resolve()), "--worker", f"--steps={args.steps}"]
    me.append(f"--warmup={args.warmup}")
    one = launch([sys.executable, *me])
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = {
        "bench": "scaleout",
        "workload": "W1 (16 prompts x 8), CPU/gloo, 2 ranks x 1 thread vs 1 process x 2",
        "steps": args.steps,
        "one_process_step_seconds": round(one["step_seconds"], 4),
    }
    for mode in ("fsdp2", "ddp"):
        two = launch([torchrun, "--standalone", "--nproc-per-node", "2", *me, f"--parallel={mode}"])
        out[mode] = {
            "two_ranks_step_seconds": round(two["step_seconds"], 4),
            "ratio": round(one["step_seconds"] / two["step_seconds"], 3),
            "collectives_ms": round(two["collectives_ms"], 3),
            "collectives_fraction_of_step": round(
                two["collectives_ms"] / 1e3 / two["step_seconds"], 4
            ),
        }
        if "rollout_sync_ms" in two:
            out[mode]["rollout_sync_ms"] = round(two["rollout_sync_ms"], 3)
    emit(out)


if __name__ == "__main__":
    main()
