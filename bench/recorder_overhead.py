"""Flight-recorder overhead on W1 (shared/bench/WORKLOADS.md), printed as one JSON line.

1. Step time with the recorder on vs off, in one run on one engine: blocks of `--block`
   steps alternate on/off (the order flips every pair to cancel drift); an "on" block's time
   includes draining the writer at its end, so all of the recorder's work is charged to it.
   A block is one commit group (`commit_every_steps`, 16) by default: a drain commits early,
   which a running daemon never waits for.
   Reported: the median over pairs of (on seconds per step / off seconds per step), and the
   parts of the overhead that a busy machine disturbs less: the process CPU-time ratio, the
   median time of a record() call (on the trainer's path) and the writer thread's busy
   seconds per step.
2. Blob write throughput: BlobStore.write (canonical digest, serialise, fsync, rename) of
   W1 batches vs a plain sequential write of the same serialised bytes, with and without
   fsync. Reported as ratios of bytes per second (blob / plain).

Usage: .venv/bin/python bench/recorder_overhead.py [--pairs 12] [--block 16] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpod.engine import Action, Engine, EngineConfig, Outcome, StepResult, Verdict
from grpod.forensics import BlobStore, FlightRecorder, ForensicsConfig

PASS = Verdict(Action.PASS)


def timed_block(
    engine: Engine, steps: int, recorder: FlightRecorder | None, record_calls: list[float]
) -> tuple[float, float]:
    """(wall, process CPU) seconds per step over `steps` W1 steps (plus the writer's drain
    when recording)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        batch = engine.rollout()
        report = engine.accumulate(batch)
        engine.apply()
        if recorder is not None:
            called = time.perf_counter()
            recorder.record(StepResult(batch, report, PASS, Outcome.APPLIED, {}))
            record_calls.append(time.perf_counter() - called)
    if recorder is not None:
        recorder.drain()
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu_started) / steps


def step_overhead(run_dir: Path, pairs: int, block: int, warmup: int) -> dict[str, float]:
    engine = Engine(EngineConfig(threads=2))  # W1: every default is the W1 setting
    recorder = FlightRecorder(run_dir, ForensicsConfig())
    recorder.start_run("bench", {"engine": engine.config.model_dump(mode="json")}, {}, "cpu")
    calls: list[float] = []
    timed_block(engine, warmup, recorder, calls)
    calls.clear()
    written, written_cpu = recorder.write_seconds_total, recorder.write_cpu_seconds_total
    on, off, ratios, cpu_ratios = [], [], [], []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        seconds = {
            flag: timed_block(engine, block, recorder if flag else None, calls) for flag in order
        }
        on.append(seconds[True][0])
        off.append(seconds[False][0])
        ratios.append(seconds[True][0] / seconds[False][0])
        cpu_ratios.append(seconds[True][1] / seconds[False][1])
    blocked = recorder.blocked_total
    writer_seconds = (recorder.write_seconds_total - written) / len(calls)
    writer_cpu = recorder.write_cpu_seconds_total - written_cpu
    recorder.close()
    off_median = statistics.median(off)
    return {
        "step_seconds_on_median": statistics.median(on),
        "step_seconds_off_median": off_median,
        "step_time_ratio_median": statistics.median(ratios),
        "step_time_ratios": [round(r, 4) for r in ratios],
        "cpu_time_ratio_median": statistics.median(cpu_ratios),  # process CPU seconds
        "recorder_blocked_total": blocked,
        "recorder_commits": recorder.commits_total,
        # the parts of the overhead, less exposed to a noisy machine than the ratio:
        "record_call_seconds_median": statistics.median(calls),  # on the trainer's path
        "writer_seconds_per_step": writer_seconds,  # in the background thread (wall)
        "writer_cpu_seconds_per_step": writer_cpu / len(calls),  # that thread's CPU time
        "writer_fraction_of_off_step": writer_seconds / off_median,
    }


def blob_throughput(run_dir: Path, batches: int) -> dict[str, float]:
    engine = Engine(EngineConfig(threads=2))
    payloads = []
    for _ in range(batches):
        batch = engine.rollout()
        payloads.append(({n: t.contiguous() for n, t in batch.tensors().items()}, batch.metadata()))
        engine.step += 1
    blobs = BlobStore(run_dir / "bench-blobs")
    started = time.perf_counter()
    total = sum(blobs.write(tensors, meta)[1] for tensors, meta in payloads)
    blob_seconds = time.perf_counter() - started
    raw = [save(tensors, metadata=meta) for tensors, meta in payloads]
    plain = {}
    for sync in (False, True):
        folder = run_dir / f"plain-{sync}"
        folder.mkdir()
        started = time.perf_counter()
        for index, data in enumerate(raw):
            with open(folder / str(index), "wb") as fh:
                fh.write(data)
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())
        plain[sync] = time.perf_counter() - started
    mb = total / 1e6
    return {
        "batch_bytes_mean": total / batches,
        "blob_write_mb_per_s": mb / blob_seconds,
        "plain_write_mb_per_s": mb / plain[False],
        "plain_write_fsync_mb_per_s": mb / plain[True],
        "blob_vs_plain_throughput_ratio": plain[False] / blob_seconds,
        "blob_vs_plain_fsync_throughput_ratio": plain[True] / blob_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--block", type=int, default=ForensicsConfig().commit_every_steps)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="grpod-bench-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        result = {"workload": "W1", "bench": "recorder_overhead", "threads": 2}
        result.update(step_overhead(run_dir / "run", args.pairs, args.block, args.warmup))
        result.update(blob_throughput(run_dir, args.batches))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
