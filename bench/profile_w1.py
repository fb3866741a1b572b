"""Profile grpod's W1 step: where the seconds of rollout + accumulate + apply go.

    .venv/bin/python bench/profile_w1.py [--steps 10] [--top 15] [--by op|python]

Set GRPOD_BENCH_ENGINE_ROOT=<dir holding another engine/> to profile that engine instead
(e.g. `git archive <commit> engine | tar -x -C /tmp/before`) for before/after tables.
`--by op` (default) ranks torch.profiler ops by self CPU time; `--by python` ranks Python
functions by cumulative time with cProfile. Both over `--steps` steps after 3 warm-up steps.
Prints the table, then one JSON line with the top costs in seconds per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from common import emit, engine_config, set_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--by", choices=("op", "python"), default="op")
    parser.add_argument("--task", default="arith")
    args = parser.parse_args()
    set_threads()
    import engine as engine_package
    from engine import Engine

    engine = Engine(engine_config(args.task))

    def step() -> None:
        batch = engine.rollout()
        engine.accumulate(batch)
        engine.apply()

    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    plain = (time.perf_counter() - started) / args.steps

    top: list[tuple[str, float]] = []
    if args.by == "op":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        top = [(e.key, e.self_cpu_time_total / 1e6 / args.steps) for e in ranked[: args.top]]
    else:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        profiler.disable()
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf).sort_stats("cumulative")
        stats.print_stats(args.top * 3)
        print(buf.getvalue())
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)
        top = [
            (f"{func[0].split('/')[-1]}:{func[1]}:{func[2]}", ct / args.steps)
            for func, (_, _, _, ct, _) in rows[: args.top * 3]
        ]
    emit(
        {
            "workload": f"profile-{args.task}",
            "by": args.by,
            "engine": engine_package.__file__.rsplit("/", 2)[0],
            "s_per_step_unprofiled": round(plain, 5),
            "top_s_per_step": [[k, round(v, 5)] for k, v in top],
        }
    )


if __name__ == "__main__":
    main()
