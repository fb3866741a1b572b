"""LoRA under torchrun vs full fine-tuning, at W2 (kv-retrieval, 256-token rows in 4 chunks),
2 ranks on gloo (CPU): step time and peak memory per rank, for `ddp` and `fsdp2`.

Each of the four settings (ddp / fsdp2, full / LoRA rank 8 on the default targets) is its own
torchrun launch of this file's worker (rollout -> accumulate -> apply, `--steps` after `--warmup`).
Per rank: the median step seconds, the process's peak RSS (`VmHWM`), and the training pass's
own peak (the high-water mark reset right before the last step's `accumulate`, minus the
RSS then). Ratios are LoRA / full per mode (the worst rank). Honestly labelled: the tiny
policy of W2 is small next to torch's own resident memory, so the whole-process ratio says
little; the training-pass peak and the optimizer state are where adapters save.
Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/lora_scaleout.py [--steps 4] [--warmup 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/lora_scaleout.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import W2_ENGINE as W2  # noqa: E402
from common import emit, reset_peak, scaleout_parser, status_kib  # noqa: E402

LORA = {"rank": 8, "alpha": 16.0}


def worker(steps: int, warmup: int, parallel: str, lora: bool, out_dir: str) -> None:
    from grpod.engine import Engine, EngineConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = {**W2, "parallel": parallel, **({"lora": LORA} if lora else {})}
        engine = Engine(EngineConfig.model_validate(config))
    seconds, train_peak = [], 0.0
    for i in range(warmup + steps):
        started = time.perf_counter()
        batch = engine.rollout()
        if i == warmup + steps - 1:
            before = reset_peak()
            engine.accumulate(batch)
            train_peak = status_kib("VmHWM") / 1024 - before
        else:
            engine.accumulate(batch)
        engine.apply()
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
    out = {
        "rank": engine.parallel.rank,
        "step_seconds": statistics.median(seconds),
        "peak_rss_mib": status_kib("VmHWM") / 1024,
        "train_peak_mib": train_peak,
        "trained_parameters": sum(p.numel() for p in engine.params),
    }
    # a file per rank: the ranks share one stdout, where their lines can interleave
    (Path(out_dir) / f"rank-{engine.parallel.rank}.json").write_text(json.dumps(out))
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # the gloo teardown abort (tests/guards/dist_worker.py)


def launch(mode: str, lora: bool, steps: int, warmup: int) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="grpod-lora-bench-")
    me = [str(Path(__file__).resolve()), "--worker", f"--steps={steps}", f"--warmup={warmup}"]
    me.append(f"--out={out_dir}")
    me += [f"--parallel={mode}"] + (["--lora"] if lora else [])
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", *me],
        cwd=ROOT,
        env=env,
        capture_output=True,
        check=True,
    )
    ranks = [json.loads((Path(out_dir) / f"rank-{r}.json").read_text()) for r in (0, 1)]
    shutil.rmtree(out_dir)
    return ranks


def main() -> None:
    parser = scaleout_parser(steps=4, warmup=1)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.warmup, args.parallel, args.lora, args.out)
    out: dict = {
        "bench": "lora_scaleout",
        "workload": "W2, 2 ranks x 1 thread, gloo (CPU); LoRA rank 8, default targets",
        "steps": args.steps,
    }
    for mode in ("ddp", "fsdp2"):
        full = launch(mode, False, args.steps, args.warmup)
        lora = launch(mode, True, args.steps, args.warmup)

        def worst(runs: list[dict], key: str) -> float:
            return max(r[key] for r in runs)

        out[mode] = {
            "full": full,
            "lora": lora,
            "step_ratio": round(worst(lora, "step_seconds") / worst(full, "step_seconds"), 3),
            "peak_rss_ratio": round(worst(lora, "peak_rss_mib") / worst(full, "peak_rss_mib"), 3),
            "train_peak_ratio": round(
                worst(lora, "train_peak_mib") / max(worst(full, "train_peak_mib"), 1e-9), 3
            ),
        }
    emit(out)


if __name__ == "__main__":
    main()
