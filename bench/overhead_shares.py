"""One part's share of the monitoring path's cost on W1: the daemon with that part switched off.

Three sides in one process: the bare engine, the daemon as it runs (`monitored`) and the same
daemon with one part off (`without`): `guards` (every guard disabled through
`GuardPolicy.reload`, their history kept), `recorder` (`record()` a no-op: those blocks' steps
are not stored), `ledger` (the recorder without its prompt ledger), `group-wake` (the writer
woken for every step, as before its inbox held a group's steps: a negative share is what
waking it once per group saves), or `nothing` (the two daemon sides alike: the calibration,
whose share should read 0 within its interval). Blocks
of `--block` steps, each daemon block ended by the recorder's drain, as in `overhead.py`.

The three sides cycle through all six orders, so each runs first, second and third, and after
each of the others, equally often. A fixed order biases the comparison: with bare, A, B in
even rounds and B, A, bare in odd ones, a null A/B (both sides the same daemon) read the
writer's CPU 0.914 against 0.757 ms a step and 0.857 against 0.689 in two runs, the side
that follows a bare block being the dearer (2026-12-05); the six orders read 0.723 against
0.705.

`share` is the median over rounds of (monitored - without) / bare seconds per step: the part's
cost as a fraction of a bare step, with a bootstrap 95% interval; `ms_per_step` the same
difference in milliseconds. Prints one JSON line (also appended to bench/out/results.jsonl).

    .venv/bin/python bench/overhead_shares.py --without guards [--rounds 42] [--block 16]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/overhead_shares.py` from the repo root
    sys.path.insert(0, str(ROOT))

from common import bootstrap_ci95, emit  # noqa: E402
from overhead import W1, bare_block, monitored_block, start_daemon  # noqa: E402

from grpod.daemon.loop import Daemon  # noqa: E402
from grpod.engine import Engine  # noqa: E402
from grpod.forensics import ForensicsConfig, list_incidents  # noqa: E402

SIDES = ("bare", "monitored", "without")
ORDERS = list(itertools.permutations(SIDES))  # each side in each place, after each other side


def switch(daemon: Daemon, part: str) -> Callable[[bool], None]:
    """`on(False)` switches `part` off in `daemon`, `on(True)` back on."""
    recorder, policy = daemon.recorder, daemon.policy
    record, ledger, put = recorder.record, recorder.ledger, recorder._put

    def put_waking(item: object, *, urgent: bool = True, nbytes: int = 0) -> None:
        put(item, urgent=True, nbytes=nbytes)  # every step wakes the writer

    guards = policy.config.model_dump()
    disabled = {
        name: {**section, "enabled": False}
        if isinstance(section, dict) and "enabled" in section
        else section
        for name, section in guards.items()
    }

    def on(state: bool) -> None:
        if part == "guards":
            policy.reload(guards if state else disabled)
        elif part == "recorder":
            recorder.record = record if state else (lambda *args, **kwargs: None)  # type: ignore[method-assign]
        elif part == "ledger":
            recorder.drain()  # the writer is idle: it reads `ledger` at its next commit
            recorder.ledger = ledger if state else None
        elif part == "group-wake":
            recorder._put = put if state else put_waking  # type: ignore[method-assign]

    return on


def campaign(
    args: argparse.Namespace,
    done: int,
    seconds: dict[str, list[float]],
    writer: dict[str, list[float]],
) -> tuple[int | None, int]:
    """Rounds from round `done` on a fresh daemon and bare engine, until `args.rounds` or the
    daemon's first HALT (W1's toy is solved and halted by `dead_campaign` near step 926; the
    round it fell in is dropped, as `overhead.py` does): (the HALT's step, incidents)."""
    with tempfile.TemporaryDirectory(prefix="grpod-shares-") as tmp:
        daemon, run_dir, log_file = start_daemon(Path(tmp), W1)
        bare = Engine(W1)
        on = switch(daemon, args.without)
        bare_block(bare, 2)
        monitored_block(daemon, 2)
        halted = None
        for round_ in range(done, args.rounds):
            measured, spent = {}, {}
            for side in ORDERS[round_ % len(ORDERS)]:
                if side == "bare":
                    measured[side] = bare_block(bare, args.block)[0]
                    continue
                on(side == "monitored")
                before = daemon.recorder.write_cpu_seconds_total
                measured[side], _, _, halted = monitored_block(daemon, args.block)
                spent[side] = daemon.recorder.write_cpu_seconds_total - before
                if halted is not None:
                    break
            if halted is not None:
                break  # the healthy run is over
            for side, wall in measured.items():
                seconds[side].append(wall / args.block)
            for side, cpu in spent.items():
                writer[side].append(cpu / args.block)
        on(True)
        daemon.recorder.close()
        daemon._close_quietly()
        log_file.close()
        return halted, len(list_incidents(run_dir.path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--without", choices=("guards", "recorder", "ledger", "group-wake", "nothing")
    )
    parser.add_argument("--rounds", type=int, default=42, help="a multiple of 6: every order")
    parser.add_argument("--block", type=int, default=ForensicsConfig().commit_every_steps)
    args = parser.parse_args()
    if args.without is None:
        parser.error("--without is required")

    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    writer: dict[str, list[float]] = {"monitored": [], "without": []}
    campaigns: list[dict[str, int | None]] = []
    while len(seconds["bare"]) < args.rounds:
        done = len(seconds["bare"])
        halted, incidents = campaign(args, done, seconds, writer)
        campaigns.append(
            {
                "rounds": len(seconds["bare"]) - done,
                "halted_at_step": halted,
                "incidents": incidents,
            }
        )
        if len(seconds["bare"]) == done:
            break  # a campaign that halts in its first round: nothing more to measure

    rounds = len(seconds["bare"])
    share = [
        (m - w) / b for b, m, w in zip(seconds["bare"], seconds["monitored"], seconds["without"])
    ]
    saved_ms = [(m - w) * 1e3 for m, w in zip(seconds["monitored"], seconds["without"])]

    def ratio(side: str) -> float:
        return round(statistics.median(b / s for b, s in zip(seconds["bare"], seconds[side])), 4)

    emit(
        {
            "bench": "overhead_shares",
            "workload": "W1",
            "without": args.without,
            "rounds": rounds,
            "block_steps": args.block,
            "campaigns": campaigns,  # a fresh daemon and engine after each HALT
            "bare_seconds_per_step": round(statistics.median(seconds["bare"]), 5),
            "ratio": ratio("monitored"),
            "ratio_without": ratio("without"),
            "share": round(statistics.median(share), 4),
            "share_ci95": [round(x, 4) for x in bootstrap_ci95(share, statistics.median)],
            "ms_per_step": round(statistics.median(saved_ms), 3),
            "ms_per_step_ci95": [round(x, 3) for x in bootstrap_ci95(saved_ms, statistics.median)],
            "writer_cpu_ms_per_step": {
                side: round(statistics.median(v) * 1e3, 3) for side, v in writer.items() if v
            },
            "by_round_ms": {side: [round(t * 1e3, 2) for t in v] for side, v in seconds.items()},
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
