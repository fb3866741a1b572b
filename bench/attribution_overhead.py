"""Incident attribution off the training path: how long it takes, and what it costs a step.

1. `attribution_seconds`: a daemon (`Daemon._step`, as bench/overhead.py) whose step 1 has
   one sample poisoned (`nan-logits`, a FLUSH: an incident), its attributor left to finish
   with the trainer idle: the wall seconds of the child process the incident stored (start,
   imports, the replay from the checkpoint, the per-sample passes) and the attribution's own
   seconds inside it. W1 by default; `--w4` also the real model (SmolLM2-135M-Instruct,
   examples/smollm2-arith/grpod.toml; `make model-smollm2` once).
2. `interference` (`--pairs N`): the on/off ratio resolved to ~1%: see `interference`.
3. `ratio`: W1 daemon steps with an attribution running beside them (a fresh
   `IncidentAttributor` per block re-attributing that incident: its niced child, 1 thread)
   over the same daemon's steps without one, in interleaved blocks (order flipped every
   round). Each side waits `--lead` seconds before its block (the child gets past its
   imports); the child is stopped at the block's end. `ratio` is the median over rounds of
   (seconds without / seconds with) per step; goal >= 0.99. `cpu_ratio`: the same of the
   daemon process's own CPU seconds per step (the child's excluded). A step's time varies
   ~10% from block to block with its data, so 8 rounds cannot resolve 1%: use `--pairs`.

Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/attribution_overhead.py [--rounds 8] [--block 32] [--w4]
    .venv/bin/python bench/attribution_overhead.py --pairs 2000 --skip-ratio
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
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
from grpod.forensics.config import GPU_RUN_FRACTION, AttributionConfig  # noqa: E402
from grpod.forensics.incident_attribution import (  # noqa: E402
    IncidentAttributor,
    child_command,
)

W4_CONFIG = ROOT / "examples" / "smollm2-arith" / "grpod.toml"
POISON = {  # step 1, sample 3: NaN hidden states from layer 1 on (a FLUSH)
    "poison_sample_steps": [1],
    "poison_sample_index": 3,
    "poison_sample_kind": "nan-logits",
    "poison_sample_layer": 1,
}


def start_daemon(tmp: Path, engine: Any, run_fraction: float) -> tuple[Daemon, Any]:
    """A started daemon on `engine` (no metrics server), its JSON log in `tmp`, its
    attribution paced at `run_fraction`."""
    run_dir = RunDir(tmp / "run")
    config = GrpodConfig(
        engine=engine,
        forensics=ForensicsConfig(
            attribution=AttributionConfig(max_seconds=7200, run_fraction=run_fraction)
        ),
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
    if not daemon.attributor.wait_idle(7200):
        raise SystemExit("the attribution did not finish within two hours")
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
        "paced_seconds": info.get("paced_seconds"),  # of the child's wall: asleep, its pace
        "seconds_per_sample": round(info["seconds"] / len(shown["samples"]), 3),
        "waited_after_step_seconds": round(waited, 3),
        "steps_replayed": info["steps_replayed"],
        "top_sample": top["index"],
        "nonfinite_module": (shown["nonfinite"] or {}).get("module"),
    }


def on_block(daemon: Daemon, block: int, lead: float, samples: int, run_fraction: float) -> float:
    """`block` steps with incident 1 being re-attributed beside them at `run_fraction` (its
    child stopped at the end); wall seconds of the steps."""
    config = daemon.config.forensics.attribution.model_copy(update={"run_fraction": run_fraction})
    attributor = IncidentAttributor(daemon.run_dir.path, config)
    attributor.submit(1, 1, samples)
    time.sleep(lead)
    try:
        return steps(daemon, block)
    finally:
        attributor.close(0.0)


def interference(daemon: Daemon, pairs: int, lead: float) -> dict[str, Any]:
    """An unpaced attribution child (incident 1, run_fraction 1, restarted when it ends)
    paused (SIGSTOP) and resumed (SIGCONT) step by step: `pairs` pairs of adjacent steps, one
    beside the running child and one beside the paused one (order flipped every pair), so
    the data's drift from step to step cancels. `interference_ratio`: the steps' seconds
    without / with over all pairs (the CPU default's on/off ratio). `child_cpu_share`: the
    child's CPU seconds over the wall seconds of the steps it ran beside: what SCHED_IDLE
    left it (a pace above that share changes nothing)."""
    config = daemon.config.forensics.attribution
    command = child_command(daemon.run_dir.path, 1, config.model_copy(update={"run_fraction": 1}))
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads)}
    child: subprocess.Popen | None = None
    walls: list[tuple[float, float]] = []  # (off, on) seconds of each pair
    cpus: list[tuple[float, float]] = []
    restarts, child_cpu, last_cpu = 0, 0.0, 0.0
    try:
        for pair in range(pairs):
            if child is None or child.poll() is not None:
                child_cpu += last_cpu  # its last reading (a reaped child has none)
                last_cpu = 0.0
                child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
                restarts += 1
                time.sleep(lead)  # past its imports
            seconds = {}
            cpu = {}
            for side in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                child.send_signal(signal.SIGCONT if side == "on" else signal.SIGSTOP)
                seconds[side] = steps(daemon, 1)
                cpu[side] = CPU[-1]
            last_cpu = cpu_seconds(child.pid) or last_cpu
            walls.append((seconds["off"], seconds["on"]))
            cpus.append((cpu["off"], cpu["on"]))
        child_cpu += last_cpu
    finally:
        if child is not None:
            child.kill()
            child.wait()

    def ratio(values: list[tuple[float, float]]) -> float:
        return sum(off for off, _ in values) / sum(on for _, on in values)

    wall_ratio = ratio(walls)
    return {
        "pairs": pairs,
        "children_started": restarts,
        "interference_ratio": round(wall_ratio, 4),
        "interference_ratio_ci95": [round(x, 4) for x in bootstrap_ci95(walls, ratio)],
        "interference_cpu_ratio": round(ratio(cpus), 4),
        "child_cpu_share": round(child_cpu / sum(on for _, on in walls), 4),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0: gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def off_block(daemon: Daemon, block: int, lead: float) -> float:
    time.sleep(lead)
    return steps(daemon, block)


def ratio_figures(
    args: argparse.Namespace,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    paired: list[float],
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "rounds": args.rounds,
        "block_steps": args.block,
        "lead_seconds": args.lead,
        "run_fraction": args.run_fraction,
        "off_seconds_per_step": round(statistics.median(times["off"]), 5),
        "on_seconds_per_step": round(statistics.median(times["on"]), 5),
        "ratio": round(statistics.median(paired), 4),
        "ratio_ci95": [round(x, 4) for x in bootstrap_ci95(paired, statistics.median)],
        "goal": 0.99,
    }
    for side in times:
        if side != "off":  # the daemon's own CPU seconds per step (its threads, not the
            # child's): what a shared machine's other tenants disturb less than the wall
            key = "cpu_ratio" if side == "on" else f"cpu_ratio_{side}"
            figures[key] = round(median_ratio(cpu["off"], cpu[side]), 4)
            if side != "on":
                figures[f"ratio_{side}"] = round(median_ratio(times["off"], times[side]), 4)
    for side in times:
        figures[f"{side}_seconds_per_step_by_block"] = [round(t, 4) for t in times[side]]
    return figures


def median_ratio(off: list[float], on: list[float]) -> float:
    return statistics.median(o / n for o, n in zip(off, on))


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
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="also the interference part: this many pairs of steps beside an unpaced child "
        "paused and resumed step by step (`interference_ratio`, `paced_estimate`)",
    )
    parser.add_argument(
        "--run-fraction",
        type=float,
        default=AttributionConfig().pace("cpu"),
        help="the attribution's pace ([forensics.attribution] run_fraction; default: a CPU "
        "run's, 1 = unpaced)",
    )
    parser.add_argument(
        "--paced-too",
        action="store_true",
        help=f"a third side in every round: the attribution paced at {GPU_RUN_FRACTION} "
        "(a GPU run's default; `ratio_paced`)",
    )
    args = parser.parse_args()
    record: dict[str, Any] = {"bench": "attribution_overhead", "workload": "W1"}
    load_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="grpod-attribution-") as tmp:
        daemon, log_file = start_daemon(
            Path(tmp), engine_config("arith", faults=POISON), args.run_fraction
        )
        try:
            record["w1"] = attribution_seconds(daemon)
            samples = record["w1"]["samples"]
            steps(daemon, 2)  # warm
            if args.pairs:
                record["interference"] = interference(daemon, args.pairs, args.lead)
            names = ["off", "on"] + (["paced"] if args.paced_too else [])
            times: dict[str, list[float]] = {name: [] for name in names}
            cpu: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(0 if args.skip_ratio else args.rounds):
                sides = names if round_ % 2 == 0 else names[::-1]
                for side in sides:
                    if side == "off":
                        wall = off_block(daemon, args.block, args.lead)
                    else:
                        fraction = args.run_fraction if side == "on" else GPU_RUN_FRACTION
                        wall = on_block(daemon, args.block, args.lead, samples, fraction)
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
            daemon, log_file = start_daemon(Path(tmp), engine, args.run_fraction)
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
