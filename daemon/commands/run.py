"""`grpod run`: the training service (daemon/loop.py). Exit 0 ok, 1 failure, 2 bad input, 3 HALT.

With no config it runs the embedded default (the tiny model on `copy`) under
./var/grpod/<run-id>, ./var/grpod/latest pointing at it. `--run-dir` on an existing run
resumes it from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from grpod.daemon.commands.args import non_negative


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run (or resume) a GRPO campaign as a service")
    p.add_argument("--config", metavar="FILE", help="grpod.toml (default: the embedded default)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory; an existing run resumes")
    p.add_argument(
        "--max-steps", type=non_negative(int), metavar="N", help="stop at step N (0 = never)"
    )
    p.add_argument(
        "--linger",
        type=non_negative(float),
        metavar="SECONDS",
        help="keep /metrics up this long after the loop stops (/healthz answers 503)",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from grpod.daemon.rundir import Plan, resolve_plan

    overrides = {}
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    if args.linger is not None:
        overrides["linger_seconds"] = args.linger
    from grpod.daemon import distributed

    def resolve() -> Plan:  # reads only; ConfigError -> 2
        plan = resolve_plan(args.config, args.run_dir, overrides)
        if plan.resume:
            plan.run_dir.lock()  # one live run per directory; a fresh one is locked as it is made
        return plan

    # under torchrun rank 0 resolves (and locks) for every rank
    plan = distributed.agree(resolve)
    if distributed.rank() != 0:
        plan.run_dir.held = None  # rank 0's lock: its descriptor means nothing here
    if distributed.world_size() > 1:  # every rank's metrics through the node's files
        distributed.use_multiprocess_metrics(plan.run_dir.path)
    from grpod.engine.preflight import preflight

    preflight(plan.config.engine)  # before anything is created: EngineError -> exit 2

    from grpod.daemon.exitcodes import EXIT_HALT, EXIT_OK
    from grpod.daemon.loop import Daemon

    code = Daemon(plan).run()
    if code in (EXIT_OK, EXIT_HALT) and distributed.rank() == 0:
        _print_summary(plan.run_dir.path, plan.config.forensics.store_url)
    if distributed.world_size() > 1:
        distributed.leave(code, together=code in (EXIT_OK, EXIT_HALT))
    return code


def _print_summary(run_dir, store_url: str) -> None:
    """Where the store is and a `grpod replay` command for one of its steps (stderr)."""
    from grpod.daemon.commands.status import store_summary

    summary = store_summary(run_dir, store_url)
    if summary is None or summary["last_step"] is None:
        return
    step = summary["incident_steps"][-1] if summary["incident_steps"] else summary["last_step"]
    print(f"store: {summary['store']} (run dir {run_dir})", file=sys.stderr)
    print(f"replay a step: grpod replay --run-dir {run_dir} --step {step}", file=sys.stderr)
