"""`grpod status [--run-dir DIR] [--json]`: last step, outcomes, incidents of a run.

Reads the daemon's status.json (live state, pid) and the store (recorded steps); both are
safe to read while the daemon runs (atomic rename; SQLite WAL).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DEFAULT_RUN_DIR = "var/grpod/latest"  # the daemon's newest run (daemon/config.py DEFAULT_ROOT)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="state of a run: last step, outcomes, incidents")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory (%(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    from grpod.daemon.rundir import existing_run_dir
    from grpod.forensics.ledger import coverage_line

    store_url = _store_url(args.run_dir)
    run = existing_run_dir(args.run_dir, store_url)  # its store at this grpod's schema
    live = run.read_status() or {}
    if live.get("state") in ("starting", "running", "stopping") and not _alive(live.get("pid")):
        live["state"] = "dead (no process; resume with grpod run --run-dir)"
    summary = store_summary(run.path, store_url, strict=True, ledger=True) or {}
    result = {"run_dir": str(run.path), "run_id": run.run_id(), **live, **summary}
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    outcomes = " ".join(f"{k} {v}" for k, v in sorted(result.get("outcomes", {}).items()))
    lines = [
        f"run {result['run_id']} in {result['run_dir']}: {result.get('state', 'unknown')}",
        f"last recorded step {result.get('last_step')} ({result.get('last_outcome')}, "
        f"{result.get('last_verdict_action')}); outcomes: {outcomes or 'none'}; "
        f"re-runs {result.get('reruns', 0)}",
        f"incidents {result.get('incidents', 0)}; latest checkpoint step "
        f"{result.get('checkpoint_step')}; last verdict {result.get('last_verdict')}",
    ]
    if result.get("ledger"):
        lines.append(coverage_line(result["ledger"]))
    if result.get("metrics") and result.get("state") == "running":
        lines.append(f"metrics {result['metrics']}")
    print("\n".join(lines))
    return 0


def store_summary(
    run_dir: str | os.PathLike, store_url: str = "", *, strict: bool = False, ledger: bool = False
) -> dict[str, Any] | None:
    """Recorded steps by outcome, re-runs, incidents, the last step (`ledger`: and the prompt
    ledger's coverage); None without a store. `strict`: a store that is there but unreadable
    is a ForensicsError (exit 2), not None."""
    from grpod.forensics.errors import ForensicsError
    from grpod.forensics.store import Store

    try:
        store = Store(run_dir, store_url, create=False)
    except ForensicsError:
        return None
    try:
        summary = store.summary()
        coverage = _coverage(store) if ledger else None
    except ForensicsError:
        if strict:
            raise
        return None
    finally:
        store.close()
    return {
        "store": store.label,  # never the password
        "outcomes": summary.outcomes,
        "reruns": summary.reruns,
        "last_step": summary.last_step,
        "last_outcome": summary.last_outcome,
        "last_verdict_action": summary.last_verdict_action,
        "incidents": len(summary.incident_steps),
        "incident_steps": list(summary.incident_steps),
        "ledger": coverage,
    }


def _coverage(store: Any) -> dict[str, Any] | None:
    """The prompt ledger's coverage of each epoch, and how many prompts are missing or
    duplicated (forensics/ledger.py); None when the store cannot say (an older schema)."""
    from grpod.forensics.errors import ForensicsError
    from grpod.forensics.ledger import check_store

    try:
        ledger = check_store(store).to_dict()
    except ForensicsError:
        return None
    counts = {k: len(ledger[k]) for k in ("missing", "duplicated")}
    return {k: ledger[k] for k in ("checked", "note", "last_step", "epochs")} | counts


def _store_url(run_dir: str) -> str:
    """The run's `[forensics] store_url` ('' without a config: existing_run_dir names why)."""
    from grpod.daemon.config import load_config
    from grpod.daemon.rundir import CONFIG_NAME

    config = os.path.join(run_dir, CONFIG_NAME)
    return load_config(config).forensics.store_url if os.path.isfile(config) else ""


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
