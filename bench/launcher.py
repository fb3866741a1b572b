"""grpod's agent (`grpod run --nproc-per-node 2`) vs plain `torchrun --nproc-per-node 2 grpod
run`: the start-up time it adds and its per-step cost, at W2 (kv-retrieval, 256-token rows in
4 chunks), 2 ranks on gloo (CPU), launches interleaved (order flipped every round).

`startup_seconds`: from the launch to the first step event of both ranks (the agent's own
pre-check of the config, run dir and model before it spawns is inside it). `step_seconds`:
the median over steps 2.. of rank 0's step-to-step interval (the log's `ts`). Ratios are
agent / torchrun (1.0 = no cost).
Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/launcher.py [--rounds 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/launcher.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import W2_ENGINE as W2  # noqa: E402
from common import emit  # noqa: E402

BIN = Path(sys.executable).parent


def config(path: Path) -> Path:
    lines = ["[engine]", *(f"{k} = {json.dumps(v)}" for k, v in W2.items())]
    lines += ["[daemon]", "metrics_port = 0", "checkpoint_every = 1000", 'progress = "off"']
    path.write_text("\n".join(lines) + "\n")
    return path


def one_launch(side: str, where: Path, steps: int) -> dict[str, float]:
    run = ["run", "--config", str(config(where / "grpod.toml")), "--run-dir", str(where / side)]
    run += ["--max-steps", str(steps)]
    if side == "agent":
        args = [str(BIN / "grpod"), run[0], "--nproc-per-node", "2", *run[1:]]
    else:
        args = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
        args += [str(BIN / "grpod"), *run]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    started = time.monotonic()
    first: dict[int, float] = {}
    stamps: list[float] = []
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") != "step":
            continue
        first.setdefault(event["rank"], time.monotonic() - started)
        if event["rank"] == 0:
            ts = datetime.datetime.fromisoformat(event["ts"].replace("Z", "+00:00"))
            stamps.append(ts.timestamp())
    assert proc.wait() == 0, f"{side} exited {proc.returncode}"
    intervals = [b - a for a, b in itertools.pairwise(stamps[1:])]  # steps 2..
    return {"startup_seconds": max(first.values()), "step_seconds": statistics.median(intervals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"agent": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("agent", "torchrun") if round_ % 2 == 0 else ("torchrun", "agent")
            for side in order:
                where = Path(tmp) / f"{side}-{round_}"
                where.mkdir()
                results[side].append(one_launch(side, where, args.steps))
    median = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in results.items()
    }
    emit(
        {
            "bench": "launcher",
            "workload": "W2, 2 ranks, gloo (CPU)",
            "rounds": args.rounds,
            "steps": args.steps,
            "agent": median["agent"],
            "torchrun": median["torchrun"],
            "startup_ratio": median["agent"]["startup_seconds"]
            / median["torchrun"]["startup_seconds"],
            "startup_added_seconds": median["agent"]["startup_seconds"]
            - median["torchrun"]["startup_seconds"],
            "step_ratio": median["agent"]["step_seconds"] / median["torchrun"]["step_seconds"],
        }
    )


if __name__ == "__main__":
    main()
