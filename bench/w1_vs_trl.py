"""W1 `tiny-arith`: grpod's engine against TRL's GRPOTrainer, interleaved step by step.

    .venv/bin/python bench/w1_vs_trl.py [--steps 40] [--idle-gap 0.3]

Prints one JSON line: per side median s/step over steps 3..N, completions/s, completion
tokens/s, peak RSS, first/last 5-step mean reward; and the grpod / TRL ratios.
"""

from __future__ import annotations

import argparse

from common import GRPOD_MATCHES_TRL, TRL_CHANGED, compare, emit, run_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--idle-gap",
        type=float,
        default=0.0,
        help="seconds of idle machine before every step (default 0: back to back)",
    )
    args = parser.parse_args()
    trace = run_interleaved("arith", args.steps, idle_gap=args.idle_gap)
    emit(
        {
            "workload": "W1",
            "steps": args.steps,
            "idle_gap_s": args.idle_gap,
            **compare(trace),
            "trl_changed": sorted(TRL_CHANGED),
            "grpod_changed": GRPOD_MATCHES_TRL,
        }
    )


if __name__ == "__main__":
    main()
