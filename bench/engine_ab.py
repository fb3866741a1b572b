"""grpod against grpod: this checkout's engine vs another commit's, interleaved step by step.

    .venv/bin/python bench/engine_ab.py --before 3948969 [--steps 30] [--task arith | --w2]

`git archive <commit> engine` is unpacked to a temporary directory and put first on the
path of one worker (GRPOD_BENCH_ENGINE_ROOT); both workers run the same W1 settings in lock
step, so the ratio is the speedup of the engine changes under identical machine load.
Prints one JSON line: per side the W1 figures and phase medians, and after / before ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile

from common import ROOT, W2_SETTINGS, _grpod_worker, emit, run_lockstep, summarise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="commit whose engine/ is the baseline")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--task", default="arith")
    parser.add_argument(
        "--w2", action="store_true", help="W2 long-prompt settings (kv-retrieval, 256 rows)"
    )
    args = parser.parse_args()
    task, overrides = ("kv-retrieval", W2_SETTINGS) if args.w2 else (args.task, {})
    with tempfile.TemporaryDirectory() as before_root:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before, "engine"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", before_root], input=archive, check=True)
        trace = run_lockstep(
            {
                "before": (
                    _grpod_worker,
                    (task, overrides),
                    {"GRPOD_BENCH_ENGINE_ROOT": before_root},
                ),
                "after": (_grpod_worker, (task, overrides), {}),
            },
            args.steps,
        )
    sides = {name: summarise(t) for name, t in trace.items()}
    phases = {
        name: {
            k: round(statistics.median(p[k] for p in t["phases"][2:]), 5) for k in t["phases"][0]
        }
        for name, t in trace.items()
    }
    emit(
        {
            "workload": "engine-ab-W2" if args.w2 else f"engine-ab-{task}",
            "before_commit": args.before,
            "steps": args.steps,
            "same_initial_weights": trace["before"]["weights"] == trace["after"]["weights"],
            "before": {**sides["before"], "phase_median_s": phases["before"]},
            "after": {**sides["after"], "phase_median_s": phases["after"]},
            "speedup_s_per_step": round(
                sides["before"]["median_s_per_step"] / sides["after"]["median_s_per_step"], 2
            ),
            "speedup_by_phase": {
                k: round(phases["before"][k] / phases["after"][k], 2)
                for k in phases["after"]
                if phases["after"][k] > 0
            },
        }
    )


if __name__ == "__main__":
    main()
