"""The guards' after-hooks against the size of their windows: CPU a step, hot, at the
default windows and at `--scale` times them.

A W1 engine runs `--collect` real steps; their (batch, report) pairs are then fed, in
turn, to two `GuardPolicy`s, one at the default windows and one with every window
(`spike`, `gradnorm_vtc_correlation`, `clip`, `dead_campaign`, `reward_trend`, `entropy`,
`reward_hacking`, `advantage`'s history) `--scale` times longer. Each policy first takes
enough steps to fill its longest window, then `--steps` more each are timed one by one
(thread CPU), the two taking turns. The guards keep running sums (guards/base.py `Window`),
so the two should cost about the same; statistics recomputed from the whole window every
step would cost about `--scale` times more in the second. This is the arithmetic alone,
hot: inside the daemon's step the same hooks take longer (bench/README.md).

    .venv/bin/python bench/guard_windows.py [--scale 8] [--steps 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/guard_windows.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import emit  # noqa: E402

from grpod.engine import Engine, EngineConfig, StepReport, TransportBatch  # noqa: E402
from grpod.guards.config import GuardsConfig  # noqa: E402
from grpod.guards.policy import GuardPolicy  # noqa: E402

WINDOWS = {  # section -> its window fields
    "spike": ("window", "min_steps"),
    "gradnorm_vtc_correlation": ("window", "min_steps"),
    "clip": ("window",),
    "dead_campaign": ("steps",),
    "reward_trend": ("window",),
    "entropy": ("window",),
    "reward_hacking": ("window", "min_steps"),
    "advantage": ("history_steps",),
}


def scaled(scale: int) -> GuardsConfig:
    """The default guards config with every window `scale` times longer."""
    base = GuardsConfig()
    sections = {
        name: {field: getattr(getattr(base, name), field) * scale for field in fields}
        for name, fields in WINDOWS.items()
    }
    return GuardsConfig(**sections)


def longest(config: GuardsConfig) -> int:
    return max(getattr(getattr(config, n), f) for n, fields in WINDOWS.items() for f in fields)


def collect(steps: int) -> list[tuple[TransportBatch, StepReport]]:
    """`steps` real W1 steps: each one's batch and report."""
    engine = Engine(EngineConfig(task="arith", threads=2))
    pairs = []
    for _ in range(steps):
        batch = engine.rollout()
        pairs.append((batch, engine.accumulate(batch)))
        engine.apply()
    return pairs


def after_cpu(configs: dict[str, GuardsConfig], pairs: list, steps: int) -> dict[str, dict]:
    """Fill each policy's windows, then time `steps` after-hooks of each, the policies taking
    turns step by step (a host that slows down meanwhile slows both): median and p90 us."""
    policies = {name: GuardPolicy(config) for name, config in configs.items()}
    for name, policy in policies.items():
        for i in range(longest(configs[name]) + 50):
            policy.after(*pairs[i % len(pairs)])
    spent: dict[str, list[float]] = {name: [] for name in policies}
    for i in range(steps):
        batch, report = pairs[i % len(pairs)]
        for name, policy in policies.items():
            started = time.thread_time_ns()
            policy.after(batch, report)
            spent[name].append((time.thread_time_ns() - started) / 1e3)
    out = {}
    for name, values in spent.items():
        values.sort()
        out[name] = {
            "median_us": round(statistics.median(values), 1),
            "p90_us": round(values[int(0.9 * len(values))], 1),
            "longest_window": longest(configs[name]),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=8, help="the second policy's window factor")
    parser.add_argument("--steps", type=int, default=600, help="timed steps a policy")
    parser.add_argument("--collect", type=int, default=48, help="real W1 steps to feed in turn")
    args = parser.parse_args()
    pairs = collect(args.collect)
    timed = after_cpu({"default": GuardsConfig(), "scaled": scaled(args.scale)}, pairs, args.steps)
    default, large = timed["default"], timed["scaled"]
    emit(
        {
            "bench": "guard_windows",
            "scale": args.scale,
            "steps": args.steps,
            "default": default,
            "scaled": large,
            "scaled_over_default": round(large["median_us"] / default["median_us"], 3),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
