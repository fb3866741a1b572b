"""Incident attribution off the training path: how long it takes, and what it costs a step.

1. `attribution_seconds`: a daemon (`Daemon._step`, as bench/overhead.py) whose step 1 has
   one sample poisoned (`nan-logits`, a FLUSH: an incident), its attributor left to finish
   with the trainer idle: the wall seconds of the child process the incident stored (start,
   imports, the replay from the checkpoint, the per-sample passes) and the attribution's own
   seconds inside it. W1 by default; `--w4` also the real model (SmolLM2-135M-Instruct,
   examples/smollm2-arith/grpod.toml; `make model-smollm2` once).
2. `ratio`: W1 daemon steps with an attribution running beside them (a fresh
   `IncidentAttributor` per block re-attributing that incident: its niced child, 1 thread)
   over the same daemon's steps without one, in interleaved blocks (order flipped every
   round). Each side waits `--lead` seconds before its block (the child gets past its
   imports); the child is stopped at the block's end. `ratio` is the median over rounds of
   (seconds without / seconds with) per step; goal >= 0.99. `cpu_ratio`: the same of the
   daemon process's own CPU seconds per step (the child's excluded).

Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/attribution_overhead.py [--rounds 8] [--block 32] [--w4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/attribution_overhead.py`
    sys.path.insert(0, str(ROOT))

from common import bootstrap_ci95, emit, engine_config  # noqa: E402

from grpod.daemon import logs  # noqa: E402
from grpod.daemon.config import DaemonConfig, GrpodConfig  # noqa: E402
from grpod.daemon.loop import Daemon  # noqa: E402
from grpod.daemon.rundir import Plan, RunDir  # noqa: E402
from grpod.forensics import ForensicsConfig, show_incident  # noqa: E402
from grpod.forensics.config import AttributionConfig  # noqa: E402
from grpod.forensics.incident_attribution import IncidentAttributor  # noqa: E402

W4_CONFIG = ROOT / "examples" / "smollm2-arith" / "grpod.toml"
POISON = {  # step 1, sample 3: NaN hidden states from layer 1 on (a FLUSH)
    "poison_sample_steps": [1],
    "poison_sample_index": 3,
    "poison_sample_kind": "nan-logits",
    "poison_sample_layer": 1,
}


def start_daemon(tmp: Path, engine: Any) -> tuple[Daemon, Any]:
    """A started daemon on `engine` (no metrics server), its JSON log in `tmp`."""
    run_dir = RunDir(tmp / "run")
    config = GrpodConfig(
        engine=engine,
        forensics=ForensicsConfig(attribution=AttributionConfig(max_seconds=3600)),
        daemon=DaemonConfig(
            run_dir=str(run_dir.path), metrics=False, log_format="json", progress="off"
        ),
    )
    plan = Plan(config, run_dir, "attribution-overhead", False, None, None)
    daemon = Daemon(plan)
    log_file = open(tmp / "daemon.log", "w")  # noqa: SIM115 - closed by the caller
    daemon.log = logs.make_logger("json", "info", stream=log_file)
    logs.bind_run(plan.run_id, 0)
    daemon._start()  # engine, guards, store, attributor, initial checkpoint
    return daemon, log_file


CPU: list[float] = []  # the daemon process's CPU seconds of each `steps` call (not children)


def steps(daemon: Daemon, count: int) -> float:
    """Wall seconds of `count` daemon steps (their CPU seconds appended to CPU)."""
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        with logs.step_context(daemon.engine.step):
            daemon._step()
    CPU.append(time.process_time() - cpu)
    return time.perf_counter() - started


def attribution_seconds(daemon: Daemon) -> dict[str, Any]:
    """Steps 0 and 1 (1 poisoned: an incident), then the incident's attribution with the
    trainer idle: its stored figures."""
    steps(daemon, 2)
    daemon.recorder.drain()
    started = time.perf_counter()
    if not daemon.attributor.wait_idle(3600):
        raise SystemExit("the attribution did not finish within an hour")
    waited = time.perf_counter() - started
    shown = show_incident(daemon.run_dir.path, 1)
    info = shown["attribution"]
    if info["status"] != "done":
        raise SystemExit(f"incident 1: attribution {info['status']}: {info['note']}")
    top = shown["samples"][0]
    return {
        "samples": len(shown["samples"]),
        "child_seconds": info["process_seconds"],  # its wall: start, imports, replay, passes
        "attribution_seconds": round(info["seconds"], 3),  # inside: replay and passes
        "seconds_per_sample": round(info["seconds"] / len(shown["samples"]), 3),
        "waited_after_step_seconds": round(waited, 3),
        "steps_replayed": info["steps_replayed"],
        "top_sample": top["index"],
        "nonfinite_module": (shown["nonfinite"] or {}).get("module"),
    }


def on_block(daemon: Daemon, block: int, lead: float, samples: int) -> float:
    """`block` steps with incident 1 being re-attributed beside them (its child stopped at
    the end); wall seconds of the steps."""
    attributor = IncidentAttributor(daemon.run_dir.path, daemon.config.forensics.attribution)
    attributor.submit(1, 1, samples)
    time.sleep(lead)
    try:
        return steps(daemon, block)
    finally:
        attributor.close(0.0)


def off_block(daemon: Daemon, block: int, lead: float) -> float:
    time.sleep(lead)
    return steps(daemon, block)


def ratio_figures(
    args: argparse.Namespace,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    paired: list[float],
) -> dict[str, Any]:
    return {
        "rounds": args.rounds,
        "block_steps": args.block,
        "lead_seconds": args.lead,
        "off_seconds_per_step": round(statistics.median(times["off"]), 5),
        "on_seconds_per_step": round(statistics.median(times["on"]), 5),
        "ratio": round(statistics.median(paired), 4),
        "ratio_ci95": [round(x, 4) for x in bootstrap_ci95(paired, statistics.median)],
        "goal": 0.99,
        # the daemon's own CPU seconds per step (its threads, not the child's): what a shared
        # machine's other tenants disturb less than the wall
        "cpu_ratio": round(statistics.median(o / n for o, n in zip(cpu["off"], cpu["on"])), 4),
        "off_seconds_per_step_by_block": [round(t, 4) for t in times["off"]],
        "on_seconds_per_step_by_block": [round(t, 4) for t in times["on"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=32, help="steps per block")
    parser.add_argument("--lead", type=float, default=5.0, help="seconds before each block")
    parser.add_argument("--w4", action="store_true", help="also the real model's attribution")
    parser.add_argument(
        "--w4-prompts",
        type=int,
        default=8,
        help="W4's prompts per step (8: the campaign's 32 samples; fewer: a shorter run)",
    )
    parser.add_argument("--skip-ratio", action="store_true", help="only the attribution times")
    args = parser.parse_args()
    record: dict[str, Any] = {"bench": "attribution_overhead", "workload": "W1"}
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="grpod-attribution-") as tmp:
        daemon, log_file = start_daemon(Path(tmp), engine_config("arith", faults=POISON))
        try:
            record["w1"] = attribution_seconds(daemon)
            samples = record["w1"]["samples"]
            steps(daemon, 2)  # warm
            times: dict[str, list[float]] = {"off": [], "on": []}
            cpu: dict[str, list[float]] = {"off": [], "on": []}
            for round_ in range(0 if args.skip_ratio else args.rounds):
                sides = ["off", "on"] if round_ % 2 == 0 else ["on", "off"]
                for side in sides:
                    if side == "on":
                        wall = on_block(daemon, args.block, args.lead, samples)
                    else:
                        wall = off_block(daemon, args.block, args.lead)
                    times[side].append(wall / args.block)
                    cpu[side].append(CPU[-1] / args.block)
        finally:
            daemon.recorder.close()
            daemon.attributor.close(0.0)
            daemon._close_quietly()
            log_file.close()
    paired = [off / on for off, on in zip(times["off"], times["on"])]
    record["load_avg_1m_start"] = load_start
    if paired:
        record.update(ratio_figures(args, times, cpu, paired))
    if args.w4:
        with tempfile.TemporaryDirectory(prefix="grpod-attribution-w4-") as tmp:
            engine = engine_config(
                str(W4_CONFIG), faults=POISON, eval_every=0, prompts_per_step=args.w4_prompts
            )
            record["w4_prompts_per_step"] = args.w4_prompts
            daemon, log_file = start_daemon(Path(tmp), engine)
            try:
                record["w4"] = attribution_seconds(daemon)
            finally:
                daemon.recorder.close()
                daemon.attributor.close(0.0)
                daemon._close_quietly()
                log_file.close()
    emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
