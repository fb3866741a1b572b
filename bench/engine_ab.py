"""grpod against grpod: this checkout's engine vs another commit's, interleaved step by step.

    .venv/bin/python bench/engine_ab.py --before 3948969 [--steps 30] [--task arith | --w2]

The other commit is checked out in a temporary `git worktree` (this checkout's working tree
and index are not touched) and its four packages are laid out as `grpod.*` in a temporary
directory put first on the path of one worker (GRPOD_BENCH_PACKAGES); both workers run the
same W1 settings in lock step, so the ratio is the speedup of the engine changes under
identical machine load. Prints one JSON line: per side the W1 figures, phase medians and
the state digest after the last step (`Engine.state_digest()`: weights, AdamW state,
schedule), whether the digests are equal, and after / before ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

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
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        git = ["git", "-C", str(ROOT)]
        subprocess.run(
            [*git, "worktree", "add", "--detach", "-q", str(source), args.before], check=True
        )
        try:
            packages = _grpod_packages(source, Path(tmp) / "site")
            trace = run_lockstep(
                {
                    "before": (
                        _grpod_worker,
                        (task, overrides),
                        {"GRPOD_BENCH_PACKAGES": packages},
                    ),
                    "after": (_grpod_worker, (task, overrides), {}),
                },
                args.steps,
            )
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(source)], check=True)
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
            "same_final_state": trace["before"]["state_digest"] == trace["after"]["state_digest"],
            "before": {
                **sides["before"],
                "phase_median_s": phases["before"],
                "state_digest": trace["before"]["state_digest"],
            },
            "after": {
                **sides["after"],
                "phase_median_s": phases["after"],
                "state_digest": trace["after"]["state_digest"],
            },
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


def _grpod_packages(source: Path, site: Path) -> str:
    """`site/grpod/...` as pyproject.toml maps a checkout: `grpod/` with `engine/`, `guards/`,
    `forensics/`, `daemon/` inside (symlinks into `source`); returns `site` for the path."""
    package = site / "grpod"
    package.mkdir(parents=True)
    for entry in (source / "grpod").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in ("engine", "guards", "forensics", "daemon"):
        (package / name).symlink_to(source / name)
    return str(site)


if __name__ == "__main__":
    main()
