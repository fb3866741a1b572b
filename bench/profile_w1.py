"""Profile grpod's W1 step: where the seconds of rollout + accumulate + apply go.

    .venv/bin/python bench/profile_w1.py [--steps 10] [--top 15] [--by op|python|phase]

Set GRPOD_BENCH_PACKAGES=<dir holding another checkout's packages as grpod/...> to profile
that engine instead (the layout bench/engine_ab.py builds from a temporary git worktree).
`--by op` (default) ranks torch.profiler ops by self CPU time; `--by python` ranks Python
functions by cumulative time with cProfile; `--by phase` times the step's phases (prefill,
decode steps, trunk layout, trunk forward, head + loss, backward, ...) with the wall clock
alone, each phase's own time without the phases inside it, as medians over the steps. All
over `--steps` steps after 3 warm-up steps. Prints the table, then one JSON line with the
top costs in seconds per step.

The profilers distort a step of many small ops: under torch.profiler an elementwise op of
W1's training pass reads ~250 us where the wall clock around the same call reads ~45 us
(2026-11-29), and cProfile charges every Python call. `--by phase` is the one to trust for
how the step's time divides; the other two say which ops and functions are inside a phase.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from common import emit, engine_config, set_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--by", choices=("op", "python", "phase"), default="op")
    parser.add_argument("--task", default="arith")
    args = parser.parse_args()
    set_threads()
    import grpod.engine as engine_package
    from grpod.engine import Engine

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
    if args.by == "phase":
        top = phase_medians(engine, step, args.steps)
        total = sum(seconds for _, seconds in top)
        print(f"{'phase':44s} {'ms/step':>8s} {'share':>6s}")
        for name, seconds in top[: args.top]:
            print(f"{name:44s} {seconds * 1e3:8.2f} {seconds / total:6.1%}")
        print(f"{'sum of phase medians':44s} {total * 1e3:8.2f}")
    elif args.by == "op":
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


class PhaseClock:
    """Wall seconds per phase; a phase's own time excludes the phases called inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [started, seconds of inner phases]

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Time `owner.attribute` (a function, method or class attribute) as phase `name`;
        an attribute this engine does not have (an older engine root) is left alone."""
        function = getattr(owner, attribute, None)
        if function is None:
            return
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            clock._stack.append([time.perf_counter(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                started, inner = clock._stack.pop()
                spent = time.perf_counter() - started
                clock.seconds[name] = clock.seconds.get(name, 0.0) + spent - inner
                if clock._stack:
                    clock._stack[-1][1] += spent

        setattr(owner, attribute, timed)


def phase_medians(engine: Any, step: Callable[[], None], steps: int) -> list[tuple[str, float]]:
    """Median own seconds per step of each phase of `step()`, largest first."""
    import torch

    import grpod.engine.grpo.trainer as trainer
    import grpod.engine.train.layout as layout

    try:
        import grpod.engine.train.forward_backward as forward_backward
    except ImportError:  # an engine from before the trainer's split
        forward_backward = None

    clock = PhaseClock()
    backward = torch.Tensor.backward
    try:
        import grpod.engine.model.fused as fused

        decoder = fused.StaticDecoder
        clock.wrap(decoder, "__init__", "rollout: decoder setup")
        clock.wrap(decoder, "prefill", "rollout: prefill")
        clock.wrap(decoder, "step", "rollout: decode steps")
    except (ImportError, AttributeError):
        pass
    # this engine's components (engine/rollout/sampling.py, engine/train/forward_backward.py),
    # or an older engine's methods of the same names
    sampling = getattr(engine, "sampling", engine)
    passes = getattr(engine, "forward_backward", engine)
    clock.wrap(sampling, "_sample", "rollout: sampling, cache, other")
    clock.wrap(trainer, "pack", "rollout: pack")
    clock.wrap(engine, "rollout", "rollout: prompts, rewards, advantages")
    clock.wrap(layout, "micro_layout", "training: trunk layout")  # trunk_passes looks it up here
    for module in (trainer, forward_backward):
        clock.wrap(module, "run_trunk", "training: trunk forward")
    clock.wrap(passes, "chunk_losses", "training: head + loss forward")
    clock.wrap(passes, "_chunk_losses", "training: head + loss forward")
    clock.wrap(torch.Tensor, "backward", "training: backward")
    clock.wrap(engine, "accumulate", "training: grad scale, norm, report")
    clock.wrap(engine, "apply", "optimizer step")
    samples: dict[str, list[float]] = {}
    try:
        for _ in range(steps):
            clock.seconds.clear()
            started = time.perf_counter()
            step()
            clock.seconds["untimed (between phases)"] = (
                time.perf_counter() - started - sum(clock.seconds.values())
            )
            for name, seconds in clock.seconds.items():
                samples.setdefault(name, []).append(seconds)
    finally:
        torch.Tensor.backward = backward  # the others die with the run
    medians = [(name, statistics.median(values)) for name, values in samples.items()]
    return sorted(medians, key=lambda item: item[1], reverse=True)


if __name__ == "__main__":
    main()
