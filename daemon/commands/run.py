"""`grpod run`: the training service (daemon/loop.py). Exit 0 ok, 1 failure, 2 bad input, 3 HALT.

With no config it runs the embedded default (the tiny model on `copy`) under
./var/grpod/<run-id>, ./var/grpod/latest pointing at it. `--run-dir` on an existing run
resumes it from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from grpod.base.oneline import say
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
    from grpod.daemon import launcher

    launcher.add_options(p)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    overrides = {}
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    if args.linger is not None:
        overrides["linger_seconds"] = args.linger
    from grpod.daemon import launcher

    if launcher.launching(args):  # `--nproc-per-node N`: this process is the job's agent
        return launcher.launch(args, overrides)
    from grpod.daemon import distributed

    if distributed.world_size() == 1:
        return _serve(_plan(args, overrides))
    from grpod.daemon.errors import BAD_INPUT_ERRORS
    from grpod.daemon.exitcodes import EXIT_BAD_INPUT, EXIT_HALT, EXIT_OK

    # a rank: every exit goes through `leave` (no interpreter finalization under gloo) and a
    # refusal any rank finds before the first step is every rank's, one line each, exit 2
    from grpod.daemon.notify import Notifier

    Notifier().register()  # under grpod's launcher: where the agent forwards signals
    daemon, refusal = None, None
    try:
        plan = _plan(args, overrides)
        from grpod.daemon.loop import Daemon

        daemon = Daemon(plan)  # binds the metrics port (local rank 0)
    except BAD_INPUT_ERRORS as exc:
        refusal = str(exc)
    refused = distributed.agree_refusal(refusal)
    if refused is not None:
        say(f"grpod run: error: {refused}")
        distributed.leave(EXIT_BAD_INPUT, together=True)
    try:
        code = _serve(plan, daemon)
    except BAD_INPUT_ERRORS as exc:  # found on some ranks only (a damaged weight file)
        say(f"grpod run: error: {exc}")
        code = EXIT_BAD_INPUT
    distributed.leave(code, together=code in (EXIT_OK, EXIT_HALT))
    return code


def _plan(args: argparse.Namespace, overrides: dict):
    """The start's plan (rank 0 resolves and locks it for every rank), its engine checked."""
    from grpod.daemon import distributed
    from grpod.daemon.rundir import Plan, resolve_plan

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
    from grpod.engine.grpo.preflight import preflight

    preflight(plan.config.engine)  # before anything is created: EngineError -> exit 2
    return plan


def _serve(plan, daemon=None) -> int:
    """The daemon's loop to its exit code; rank 0 prints where the store is."""
    from grpod.daemon import distributed
    from grpod.daemon.exitcodes import EXIT_HALT, EXIT_OK
    from grpod.daemon.loop import Daemon

    code = (daemon or Daemon(plan)).run()
    if code in (EXIT_OK, EXIT_HALT) and distributed.rank() == 0:
        _print_summary(plan.run_dir.path, plan.config.forensics.store_url)
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
