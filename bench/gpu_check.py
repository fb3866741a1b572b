"""GPU node check: grpod's CUDA path measured in one call, one JSON file and a short table.

    bash scripts/gpu_check.sh [--out FILE] [--wheels DIR] [--budget SECONDS]   # a CUDA node
    bash scripts/gpu_check.sh --dry-run                                        # CPU, CI

`setup` makes a venv over the node's own Python stack (its torch, transformers, ...) with the
carried wheels of what it lacks and grpod itself (scripts/gpu_check.sh calls it first); `run`
then runs every section below in its own child process with a timeout, so a CUDA fault or a
hang in one leaves the others' results, and writes the JSON after each section:

    tests      `pytest -m gpu` and tests/engine with GRPOD_TEST_DEVICE=cuda
    numerics   logprob error vs FP64, accumulation error, zeroed target gradients
    campaign   `grpod run` on W1 and a W3-shaped model: s/step by phase, completions/s, memory
    replay     a recorded step replayed on the same machine, under three determinism settings
    mfu        W3 training FLOP/s over a bf16 matmul peak timed in the same run
    flashinfer top-p sampling and decode attention against the torch path, if importable
    fsdp2      the W1 campaign under `torchrun --nproc-per-node 1` with FSDP2, once it exists

`--dry-run` runs every section on the CPU at a tiny size for one iteration (CI checks that
the script parses, finds its inputs and that every measurement function runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]  # `common`, `w3_mfu` and the gpu_* modules import flat

SCHEMA = "grpod-gpu-check/1"
# section -> (module, function, seconds it may take on the node); issue 17's order
SECTIONS: dict[str, tuple[str, str, int]] = {
    "tests": ("gpu_runs", "tests", 200),
    "numerics": ("gpu_numerics", "numerics", 120),
    "campaign": ("gpu_runs", "campaign", 100),
    "replay": ("gpu_runs", "replay", 120),
    "mfu": ("gpu_kernels", "mfu", 60),
    "flashinfer": ("gpu_kernels", "flashinfer", 45),
    "fsdp2": ("gpu_runs", "fsdp2", 60),
}
MIN_SECTION_SECONDS = 15  # a section that would get less is recorded as not run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="make the venv the check runs in; prints its python")
    setup.add_argument("--venv", required=True)
    setup.add_argument("--wheels", default=str(ROOT / ".whl"))
    setup.add_argument("--report", help="write the setup's JSON here")
    run = sub.add_parser("run", help="run the sections; write the JSON and print the table")
    run.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu_check.json"))
    run.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, one iteration")
    run.add_argument("--budget", type=float, default=540.0, help="seconds for all sections")
    run.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="these sections only")
    run.add_argument("--setup-report", help="the JSON `setup --report` wrote")
    run.add_argument("--numerics-shape", choices=("qwen2-0.5b", "w3"), default="qwen2-0.5b")
    one = sub.add_parser("section", help="(internal) one section in this process")
    one.add_argument("name", choices=sorted(SECTIONS))
    one.add_argument("--result", required=True)
    one.add_argument("--dry-run", action="store_true")
    one.add_argument("--numerics-shape", default="qwen2-0.5b")
    args = parser.parse_args(argv)
    if args.command == "setup":
        from gpu_env import setup_venv

        report = setup_venv(Path(args.venv), Path(args.wheels))
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
        print(report["python"])
        return 0 if report["status"] == "ok" else 2
    if args.command == "section":
        return _section(args.name, Path(args.result), args.dry_run, args.numerics_shape)
    return _run(args)


def _section(name: str, result: Path, dry_run: bool, numerics_shape: str) -> int:
    """Run one section here and write its dict to `result` (the parent reads it)."""
    out = _measure(name, dry_run, numerics_shape)
    result.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    return 0


def _measure(name: str, dry_run: bool, numerics_shape: str) -> dict[str, Any]:
    import importlib

    module, function, _ = SECTIONS[name]
    options = {"numerics_shape": numerics_shape} if name == "numerics" else {}
    started = time.perf_counter()
    out = getattr(importlib.import_module(module), function)(dry_run=dry_run, **options)
    out.setdefault("status", "ok")
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _inline(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A dry run's section in this process; an exception is its error, as in a child."""
    started = time.perf_counter()
    try:
        return _measure(name, args.dry_run, args.numerics_shape)
    except Exception as exc:
        return {
            "status": "error",
            "seconds": round(time.perf_counter() - started, 1),
            "reason": f"{type(exc).__name__}: {exc}"[:300],
        }


def _run(args: argparse.Namespace) -> int:
    device = _device(args.dry_run)
    if device is None:
        print("gpu_check: error: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "dry_run": args.dry_run,
        "device": device,
        "versions": _versions(),
        "commit": _commit(),
        "setup": json.loads(Path(args.setup_report).read_text()) if args.setup_report else None,
        "sections": {},
    }
    deadline = time.monotonic() + args.budget
    for name in args.only or SECTIONS:
        left = deadline - time.monotonic()
        if left < MIN_SECTION_SECONDS:
            record["sections"][name] = {"status": "not run", "reason": "the budget ran out"}
        else:
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            if args.dry_run and name != "fsdp2":  # CI's time: one section takes the child path
                record["sections"][name] = _inline(name, args)
            else:
                record["sections"][name] = _child(name, min(SECTIONS[name][2], left), out, args)
        out.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    table = format_table(record)
    out.with_suffix(".txt").write_text(table + "\n")
    print(table)
    print(f"gpu_check: wrote {out}", file=sys.stderr)
    return 0


def _child(name: str, timeout: float, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One section in a child process: a CUDA fault or a hang costs that section only."""
    result = out.with_name(f".{out.stem}.{name}.json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "section", name, "--result", str(result)]
    cmd += ["--numerics-shape", args.numerics_shape] + (["--dry-run"] if args.dry_run else [])
    started = time.perf_counter()
    # its own process group: a timeout also ends the grpod / pytest processes it started
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {
            "status": "timeout",
            "seconds": round(timeout, 1),
            "reason": f"over {timeout:.0f} s",
        }
    sys.stderr.write(stderr[-4000:])  # its progress and warnings, after the fact
    if result.exists():
        data = json.loads(result.read_text())
        result.unlink()
        return data
    last = stderr.strip().splitlines()[-1:] or [""]
    return {
        "status": "error",
        "seconds": round(time.perf_counter() - started, 1),
        "reason": f"exit {proc.returncode}: {last[0][:300]}",
    }


def _device(dry_run: bool) -> dict[str, Any] | None:
    import torch

    if dry_run:
        return {"type": "cpu", "name": platform.processor() or platform.machine()}
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "type": "cuda",
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _nvidia_smi("driver_version"),
        "cuda_runtime": torch.version.cuda,
    }


def _nvidia_smi(field: str) -> str | None:
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return text.strip().splitlines()[0] if text.strip() else None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "flashinfer-python", "pydantic", "grpod"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _commit() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return proc.stdout.strip() or None


def format_table(record: dict[str, Any]) -> str:
    """The short table: one line per section with its headline numbers."""
    device = record["device"]
    lines = [
        f"grpod GPU node check  {record['date']}  {device.get('name')}  "
        f"torch {record['versions'].get('torch')}  commit {record.get('commit')}"
        + ("  (DRY RUN, CPU)" if record["dry_run"] else ""),
        f"{'section':<11} {'status':<8} {'s':>6}  headline",
    ]
    for name, data in record["sections"].items():
        seconds = data.get("seconds")
        text = headline(name, data) if data.get("status") == "ok" else data.get("reason", "")
        lines.append(
            f"{name:<11} {data.get('status', '?'):<8} "
            f"{'' if seconds is None else f'{seconds:.0f}':>6}  {text}"
        )
    return "\n".join(lines)


def headline(name: str, d: dict[str, Any]) -> str:
    """A section's few numbers for the table (the JSON has the rest)."""
    if name == "tests":
        parts = [("gpu", d["gpu_marked"]), ("engine", d["engine_on_device"])]
        return "  ".join(
            f"{label} {p.get('passed', '?')} passed {p.get('failures', '?')} failed "
            f"{p.get('errors', '?')} errors {p.get('skipped', '?')} skipped"
            for label, p in parts
        )
    if name == "numerics":
        e, z = d["logprob_error_nats"], d["zeroed_target_grad_fraction"]
        acc = d["grad_accumulation_rel_l2"]
        cases = ("bf16_trunk_fp32_head", "bf16_trunk_bf16_head", "fp32")
        return (
            "p90/p99 nats "
            + " ".join(f"{c.split('_head')[0]}:{e[c]['p90']:.2g}/{e[c]['p99']:.2g}" for c in cases)
            + f" (T {e['temperature']}); zeroed@p>=.88 "
            + "/".join(str(z[c]) for c in cases)
            + "; accum rel L2 "
            + " ".join(f"{m}: fp32 {a['fp32']:.2g} bf16 {a['bf16']:.2g}" for m, a in acc.items())
        )
    if name in ("campaign", "fsdp2"):
        runs = d["runs"] if name == "campaign" else {"W1": d["run"]}
        return "  ".join(
            f"{k} {r.get('median_s_per_step', '?')} s/step {r.get('completions_per_s', '?')} "
            f"compl/s gpu {r.get('peak_gpu_mib')} MiB"
            for k, r in runs.items()
        )
    if name == "replay":
        return "  ".join(
            f"{k}: {'exact' if v.get('reproduced') else v.get('field') or v.get('reason')}"
            for k, v in d.items()
            if isinstance(v, dict)
        )
    if name == "mfu":
        return (
            f"{d['achieved_gflop_per_s']:.0f} / {d['matmul_peak_gflop_per_s']:.0f} GFLOP/s "
            f"= MFU {d['mfu']:.2%}  ({d['grpod']['median_s_per_step']} s/step)"
        )
    if name == "flashinfer":
        s, a = d["sampling"], d["decode_attention"]
        return (
            f"vs {d['compared']}: TV {s.get('tv_distance_torch', '?'):.3g}/"
            f"{s.get('tv_distance_other', '?'):.3g}, decode rel err {a.get('rel_error', '?'):.2g}"
        )
    return ""


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
