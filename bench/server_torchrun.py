"""A vLLM server under torchrun (one per node, engine/rollout/sampling.py): W1 steps per second of
`grpod run` in one process against `grpod run --nproc-per-node 2` (FSDP2, gloo), both with
`rollout_backend = "vllm-server"`, at `max_staleness` 0 and 1.

Each side is a whole `grpod run` job (its own server start, not timed); the sides run one
after another, in `--rounds` rounds of alternating order. A step's seconds are the gaps
between rank 0's consecutive `step` log lines after the first `--warmup` steps (every guard,
the recorder and the checkpoints included); the push and check seconds are rank 0's `sync`
and `sync_check` phases, and rank 1's `sync` is its wait for the node's push.

    .venv-vllm/bin/python bench/server_torchrun.py [--steps 14] [--rounds 1]

Prints one JSON line (also appended to bench/out/results.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import emit  # noqa: E402

from tests.daemon.helpers import SERVER_ENGINE, write_config  # noqa: E402

GRPOD = str(Path(sys.executable).with_name("grpod"))
SIDES = {  # name: (ranks, max_staleness)
    "1proc-k0": (1, 0),
    "2rank-k0": (2, 0),
    "1proc-k1": (1, 1),
    "2rank-k1": (2, 1),
}


def run_side(ranks: int, staleness: int, steps: int, work: Path) -> list[dict]:
    work.mkdir(parents=True)
    write_config(
        work / "grpod.toml",
        {
            "engine": {**SERVER_ENGINE, "max_new_tokens": 8, "max_staleness": staleness},
            "daemon": {"metrics": False, "log_format": "json", "progress": "off"},
        },
    )
    launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    done = subprocess.run(
        [
            GRPOD,
            "run",
            *launch,
            "--config",
            "grpod.toml",
            "--run-dir",
            "run",
            "--max-steps",
            str(steps),
        ],
        cwd=work,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"server_torchrun: {ranks} rank(s) k={staleness}: {done.stderr[-2000:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "step"]


def summarise(steps: list[dict], warmup: int) -> dict:
    def rank(r: int) -> list[dict]:
        return sorted((e for e in steps if e.get("rank", 0) == r), key=lambda e: e["step"])

    mine = rank(0)
    times = [datetime.datetime.fromisoformat(e["ts"]) for e in mine]
    gaps = [(b - a).total_seconds() for a, b in zip(times[warmup:], times[warmup + 1 :])]
    med = statistics.median(gaps)

    def phase(events: list[dict], name: str) -> float:
        return round(statistics.median(e["phase_seconds"][name] for e in events[warmup:]), 4)

    out = {
        "steps_timed": len(gaps),
        "median_s_per_step": round(med, 4),
        "steps_per_s": round(1 / med, 3),
        "rank0_sync_s": phase(mine, "sync"),
        "rank0_sync_check_s": phase(mine, "sync_check"),
        "rank0_rollout_s": phase(mine, "rollout"),
        "applied": sum(e["outcome"] == "applied" for e in mine),
    }
    peer = rank(1)
    if peer:
        out["rank1_sync_s"] = phase(peer, "sync")
        out["rank1_rollout_s"] = phase(peer, "rollout")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    gaps: dict[str, list[dict]] = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            for name in order:
                ranks, k = SIDES[name]
                steps = run_side(ranks, k, args.steps, Path(tmp) / f"{name}-{r}")
                gaps[name].append(summarise(steps, args.warmup))
    sides = {name: runs[0] if len(runs) == 1 else runs for name, runs in gaps.items()}

    def rate(name: str) -> float:
        runs = gaps[name]
        return statistics.median(run["steps_per_s"] for run in runs)

    emit(
        {
            "workload": "server-torchrun-W1",
            "steps": args.steps,
            "rounds": args.rounds,
            "sides": sides,
            "ratios_steps_per_s": {
                "2rank_vs_1proc_k0": round(rate("2rank-k0") / rate("1proc-k0"), 3),
                "2rank_vs_1proc_k1": round(rate("2rank-k1") / rate("1proc-k1"), 3),
                "2rank_k1_vs_k0": round(rate("2rank-k1") / rate("2rank-k0"), 3),
            },
        }
    )


if __name__ == "__main__":
    main()
