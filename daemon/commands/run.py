"""`grpod run`: until the daemon loop lands, a plain engine-only campaign, one line per step."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a GRPO campaign")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--run-dir", default="var/grpod/demo")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(task="copy", threads=2))
    for _ in range(args.max_steps):
        report = engine.accumulate(engine.rollout())
        engine.apply()
        print(
            json.dumps(
                {"step": report.step, "reward_mean": report.reward_mean, "loss": report.loss}
            )
        )
    return 0
