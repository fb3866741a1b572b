"""The monitoring path's cost on W1: steps/s with metrics + logs + guards + recorder on, over
steps/s of the bare engine loop (rollout -> accumulate -> apply), interleaved in one run.

The monitored side is the daemon's own step (`Daemon._step`: decide_step, Prometheus
metrics, a JSON log line, status, the flight recorder writing every batch to a SQLite store
with its blobs); the bare side is the engine alone with the same config, so both see the same
batches. Blocks of steps alternate between the sides (order flipped every round, so drift in
the shared machine's load hits both); a monitored block ends with the recorder drained, so
the background writes are paid inside the block (their fsync waits included, which a
running daemon never waits for). A block is one recorder commit group (`[forensics]
commit_every_steps`, 16) by default: a drain commits early, so shorter blocks charge the
monitored side more commits than a campaign pays. `ratio` is the median over rounds of
(bare seconds / monitored seconds) per step, i.e. monitored steps/s over bare steps/s, and
`ratio_ci95` a bootstrap 95% interval of that median.
Prints one JSON line (also appended to bench/out/results.jsonl); goal: ratio >= 0.99.
The rounds (or pairs) stop at the monitored side's first HALT (`halted_at_step`): W1's toy
task saturates after ~900 steps and the `dead_campaign` guard halts it (2026-12-04: step 926),
and what follows, flushed steps with an incident's work, is not a healthy step's fixed cost;
the 120 rounds of 16 below take ~1,900 steps a side, so they end early.
Blocks resolve about 1.5% at 120 rounds (`ratio_ci95`). `--pairs N` pairs single steps
instead (`paired_steps`), which resolves about 1%, but charges less than a campaign pays: a
background thread's work (the recorder's writer) runs beside whichever step comes next, and
every other step is a bare one. On W1 that work holds the GIL about as long as it runs (a
busy thread of 1 ms slows a W1 step by 1.0 ms), so half of it lands on the bare side. Pairs
therefore bound the ratio from both ends: `ratio` (the writer's work shared by both sides)
and `ratio_writer_charged` (its whole CPU time added to the monitored side, which counts
the half that fell there twice); `ratio_background_charged` adds the publish thread's bursts
(`[daemon] publish_hold_seconds`, daemon/sink.py) the same way. The blocks' `ratio_drain_at_cpu`
is the figure a campaign sees. `--publish-hold 0` publishes every step at once (A/B).
`--workload W4` measures the real model (examples/smollm2-arith, the torch sampler); its
steps take seconds, so pairs (the same step of the same data on both sides) are the mode
that resolves anything there.

    .venv/bin/python bench/overhead.py [--rounds 120] [--block 16]
    .venv/bin/python bench/overhead.py --pairs 1000
    .venv/bin/python bench/overhead.py --workload W4 --pairs 24   # the real model, ~8 min
    python bench/overhead.py --device cuda --pairs 600   # a GPU node (scripts/gpu_check.sh's venv)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/overhead.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import bootstrap_ci95, emit, workload_config  # noqa: E402

from grpod.daemon import logs  # noqa: E402
from grpod.daemon.config import DaemonConfig, GrpodConfig  # noqa: E402
from grpod.daemon.loop import Daemon  # noqa: E402
from grpod.daemon.rundir import Plan, RunDir  # noqa: E402
from grpod.engine import Engine, EngineConfig  # noqa: E402
from grpod.engine.verdict import Action  # noqa: E402
from grpod.forensics import ForensicsConfig, list_incidents  # noqa: E402
from grpod.forensics.config import AttributionConfig  # noqa: E402

W1 = EngineConfig(task="arith", threads=2)  # 16 prompts x 8 completions, 4 new tokens, lr 1e-3


def start_daemon(
    tmp: Path,
    workload: EngineConfig,
    *,
    attribution: bool = False,
    publish_hold: float | None = None,
) -> tuple[Daemon, RunDir, TextIO]:
    """A started daemon on `workload` in a run dir under `tmp` (engine, guards, store, initial
    checkpoint, /metrics on a free port), its JSON log into `tmp`/daemon.log: (the daemon,
    its run dir, the log file the caller closes)."""
    run_dir = RunDir(tmp / "run")
    hold = {} if publish_hold is None else {"publish_hold_seconds": publish_hold}
    config = GrpodConfig(
        engine=workload,
        forensics=ForensicsConfig(attribution=AttributionConfig(enabled=attribution)),
        daemon=DaemonConfig(
            run_dir=str(run_dir.path), metrics_port=0, log_format="json", progress="off", **hold
        ),
    )
    plan = Plan(config, run_dir, "overhead", False, None, None)
    daemon = Daemon(plan)
    log_file = open(tmp / "daemon.log", "w")  # noqa: SIM115 - the caller closes it
    daemon.log = logs.make_logger("json", "info", stream=log_file)
    logs.bind_run(plan.run_id, 0)
    daemon._start()
    return daemon, run_dir, log_file


def bare_block(engine: Engine, steps: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of `steps` bare steps."""
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.accumulate(engine.rollout())
        engine.apply()
    return time.perf_counter() - started, time.process_time() - cpu


def daemon_steps(daemon: Daemon, steps: int) -> int | None:
    """`steps` daemon steps; the first that HALTed (None: none did)."""
    halted = None
    for _ in range(steps):
        step = daemon.engine.step
        with logs.step_context(step):
            if daemon._step() >= Action.HALT and halted is None:
                halted = step
    return halted


def monitored_block(daemon: Daemon, steps: int) -> tuple[float, float, float, int | None]:
    """(wall seconds with the drain's wall, wall seconds with the drain's writer CPU, process
    CPU seconds of every thread, the first step that HALTed) of `steps` daemon steps and the
    recorder's drain after them."""
    recorder = daemon.recorder
    started, cpu = time.perf_counter(), time.process_time()
    halted = daemon_steps(daemon, steps)
    daemon.sink.flush()  # the held steps' metrics and lines belong to this side
    stepped, writer_cpu = time.perf_counter(), recorder.write_cpu_seconds_total
    recorder.drain()  # the recorder's background writes belong to this side
    drain_cpu = recorder.write_cpu_seconds_total - writer_cpu
    ended = time.perf_counter()
    return ended - started, stepped - started + drain_cpu, time.process_time() - cpu, halted


def paired_steps(daemon: Daemon, bare: Engine, pairs: int) -> dict[str, Any]:
    """`pairs` pairs of single steps, one bare and one monitored (order flipped every pair):
    both engines start alike and take the same step of the same data in each pair, so the
    data's drift from step to step (~10% from block to block on W1) cancels. The recorder is
    not drained between steps (a running daemon never waits for it); its drain at the end is
    added to the monitored side. `ratio`: bare seconds / monitored seconds over all pairs,
    with a bootstrap 95% interval over the pairs; `ratio_writer_charged`: the same with the
    writer's CPU seconds in these pairs added to the monitored side (the module doc)."""
    walls: list[tuple[float, float]] = []
    writer_cpu = daemon.recorder.write_cpu_seconds_total
    publish_cpu = daemon.sink.background_cpu_seconds
    halted = None
    for pair in range(pairs):
        seconds = {}
        for side in ("bare", "monitored") if pair % 2 == 0 else ("monitored", "bare"):
            if side == "bare":
                seconds[side] = bare_block(bare, 1)[0]
            else:
                started = time.perf_counter()
                halted = daemon_steps(daemon, 1)
                seconds[side] = time.perf_counter() - started
        if halted is not None:
            pairs = pair  # the pair with a HALT and all after it: not a healthy step's cost
            break
        walls.append((seconds["bare"], seconds["monitored"]))
    started = time.perf_counter()
    daemon.sink.flush()
    daemon.recorder.drain()
    drain = time.perf_counter() - started
    writer_cpu = daemon.recorder.write_cpu_seconds_total - writer_cpu
    publish_cpu = daemon.sink.background_cpu_seconds - publish_cpu

    def ratio(values: list[tuple[float, float]]) -> float:
        share = drain * len(values) / len(walls)  # the drain, spread over the pairs
        return sum(b for b, _ in values) / (sum(m for _, m in values) + share)

    return {
        "pairs": pairs,
        "ratio": round(ratio(walls), 4),
        "ratio_ci95": [round(x, 4) for x in bootstrap_ci95(walls, ratio)],  # type: ignore[arg-type]
        "ratio_writer_charged": round(
            sum(b for b, _ in walls) / (sum(m for _, m in walls) + drain + writer_cpu), 4
        ),
        # also the publisher thread's bursts (daemon/sink.py) at their whole CPU time
        "ratio_background_charged": round(
            sum(b for b, _ in walls)
            / (sum(m for _, m in walls) + drain + writer_cpu + publish_cpu),
            4,
        ),
        "publish_background_cpu_seconds_per_step": round(publish_cpu / max(pairs, 1), 6),
        "bare_seconds_per_step": round(sum(b for b, _ in walls) / pairs, 5),
        "monitored_seconds_per_step": round((sum(m for _, m in walls) + drain) / pairs, 5),
        "final_drain_seconds": round(drain, 4),
        "halted_at_step": halted,
    }


def time_parts(daemon: Daemon) -> dict[str, list[float]]:
    """Wrap the monitored side's own parts of a step (the guards' hooks, the publication) in
    timers: each call's wall seconds, appended to the returned lists (`--parts`; the
    wrappers add a few microseconds a step)."""
    parts: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        inner, spent = getattr(owner, name), parts.setdefault(label, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    for hook in ("before", "after", "decide", "after_apply"):
        timed(daemon.policy, hook, f"guards.{hook}")
    timed(daemon.sink, "publish", "publish")
    return parts


def median_ci95(values: list[float]) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of the median of `values` (fixed seed)."""
    return bootstrap_ci95(values, statistics.median)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)  # more pairs: a steadier median
    group = ForensicsConfig().commit_every_steps
    parser.add_argument("--block", type=int, default=group, help="steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="instead of blocks: this many pairs of single steps (`paired`, resolves ~1%%)",
    )
    parser.add_argument(
        "--no-attribution",
        action="store_true",
        help="the incidents' attribution off (W1's spike WARNs each start one): the fixed cost",
    )
    parser.add_argument(
        "--publish-hold",
        type=float,
        default=DaemonConfig().publish_hold_seconds,
        help="[daemon] publish_hold_seconds (0: every step's metrics and line at once)",
    )
    parser.add_argument(
        "--device", default="cpu", help="the device (cuda: the fixed cost on a GPU node)"
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also the median milliseconds of the guards' hooks and the publication a step",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=W1.threads,
        help="W1's torch threads (1 on two cores: a core left to grpod's own threads)",
    )
    parser.add_argument(
        "--workload",
        choices=("W1", "W4"),
        default="W1",
        help="W4: the real model (examples/smollm2-arith), ~9 s a step here: use --pairs",
    )
    args = parser.parse_args()
    if args.workload == "W4":
        workload = workload_config("W4", device=args.device)
    else:
        workload = EngineConfig(
            **{**W1.model_dump(), "device": args.device, "threads": args.threads}
        )

    with tempfile.TemporaryDirectory(prefix="grpod-overhead-") as tmp:
        daemon, run_dir, log_file = start_daemon(
            Path(tmp), workload, attribution=not args.no_attribution, publish_hold=args.publish_hold
        )
        bare = Engine(workload)
        parts = time_parts(daemon) if args.parts else {}

        bare_block(bare, args.warmup)
        monitored_block(daemon, args.warmup)
        times: dict[str, list[float]] = {"bare": [], "monitored": []}
        cpu: dict[str, list[float]] = {"bare": [], "monitored": []}
        charged_times: list[float] = []  # the drain charged at the writer's CPU, not its wall
        paired_figures = paired_steps(daemon, bare, args.pairs) if args.pairs else None
        halted = None  # the first HALT: the healthy run is over (module doc)
        for round_ in range(0 if args.pairs else args.rounds):
            sides = ["bare", "monitored"] if round_ % 2 == 0 else ["monitored", "bare"]
            measured: dict[str, tuple[float, float, float]] = {}
            for side in sides:
                if side == "bare":
                    wall, used = bare_block(bare, args.block)
                    measured[side] = (wall, wall, used)
                else:
                    wall, charged, used, halted = monitored_block(daemon, args.block)
                    measured[side] = (wall, charged, used)
            if halted is not None:
                break  # the round with a HALT and all after it: not a healthy step's cost
            for side, (wall, charged, used) in measured.items():
                times[side].append(wall / args.block)
                cpu[side].append(used / args.block)
                if side == "monitored":
                    charged_times.append(charged / args.block)
        daemon.recorder.close()
        daemon._close_quietly()
        log_file.close()
        recorded = daemon.recorder.recorded_total
        # a healthy run opens none: one here is a false alarm (and its attribution ran beside
        # the monitored blocks)
        incidents = [
            {k: shown[k] for k in ("id", "step", "action", "guards") if k in shown}
            for shown in list_incidents(run_dir.path)
        ]
        writer_cpu = daemon.recorder.write_cpu_seconds_total / max(recorded, 1)
        parts_ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in parts.items() if v}
        commits = daemon.recorder.commits_total

    if paired_figures is not None:
        emit(
            {
                "bench": "overhead",
                "workload": args.workload,
                "torch_threads": workload.threads,
                "device": args.device,
                "paired": paired_figures,
                "goal": 0.99,
                "attribution": not args.no_attribution,
                "publish_hold_seconds": args.publish_hold,
                "recorded_steps": recorded,
                "recorder_commits": commits,
                "incidents": incidents,
                "writer_cpu_seconds_per_step": round(writer_cpu, 6),
                "parts_median_ms": parts_ms,
            }
        )
        return 0
    bare_s = statistics.median(times["bare"])
    monitored_s = statistics.median(times["monitored"])
    # each round's two blocks ran back to back: their ratio cancels slow drift in the load
    paired = [b / m for b, m in zip(times["bare"], times["monitored"])]
    emit(
        {
            "bench": "overhead",
            "workload": args.workload,
            "torch_threads": workload.threads,
            "device": args.device,
            "rounds": len(times["monitored"]),
            "rounds_asked": args.rounds,
            "halted_at_step": halted,
            "block_steps": args.block,
            "bare_seconds_per_step": round(bare_s, 5),
            "monitored_seconds_per_step": round(monitored_s, 5),
            "bare_steps_per_second": round(1 / bare_s, 3),
            "monitored_steps_per_second": round(1 / monitored_s, 3),
            "ratio": round(statistics.median(paired), 4),
            # the spread of that median over the rounds (bootstrap): a goal inside it is not
            # met or missed by this run alone
            "ratio_ci95": [round(x, 4) for x in median_ci95(paired)],
            "ratio_of_medians": round(bare_s / monitored_s, 4),
            # the drain at a block's end charged at the writer's CPU seconds instead of its
            # wall seconds (which wait on fsyncs a running daemon never waits for)
            "ratio_drain_at_cpu": round(
                statistics.median(b / m for b, m in zip(times["bare"], charged_times)), 4
            ),
            # CPU seconds per step (all threads): less sensitive to other tenants' load
            "cpu_ratio": round(
                statistics.median(cpu["bare"]) / statistics.median(cpu["monitored"]), 4
            ),
            "goal": 0.99,
            "publish_hold_seconds": args.publish_hold,
            "recorded_steps": recorded,
            "recorder_commits": commits,
            "incidents": incidents,
            "writer_cpu_seconds_per_step": round(writer_cpu, 6),  # the recorder thread's CPU
            "parts_median_ms": parts_ms,
            "bare_seconds_per_step_by_block": [round(t, 4) for t in times["bare"]],
            "monitored_seconds_per_step_by_block": [round(t, 4) for t in times["monitored"]],
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
