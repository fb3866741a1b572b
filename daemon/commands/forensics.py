"""`grpod db upgrade`, `grpod replay`, `grpod incidents list|show|export`, `grpod fsck`, `grpod gc`.

Bad input raises ForensicsError (one line, exit 2, nothing modified). `replay` exits 0 when
the step reproduced and 1 when it diverged; `fsck` exits 1 when it found a problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from grpod.daemon.commands.args import non_negative
from grpod.daemon.commands.status import DEFAULT_RUN_DIR
from grpod.daemon.exitcodes import EXIT_FAILURE, EXIT_OK

if TYPE_CHECKING:
    from grpod.daemon.rundir import RunDir

SHOWN_ROWS = 8  # `incidents show --by-sample`: the top sample rows (replay --by-sample: all)


def register(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory (%(default)s)")
    common.add_argument("--store-url", default="", help="store URL (default: the run dir's)")

    db = sub.add_parser("db", help="the forensic store's schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_sub.add_parser("upgrade", parents=[common], help="migrate to the newest schema")
    upgrade.set_defaults(handler=_db_upgrade)

    replay = sub.add_parser("replay", parents=[common], help="replay a recorded step")
    replay.add_argument("incident", nargs="?", type=int, metavar="INCIDENT_ID")
    replay.add_argument("--step", type=int, help="replay this step instead of an incident")
    replay.add_argument("--trace", action="store_true", help="per-micro, per-chunk trace")
    replay.add_argument("--json", action="store_true", help="one JSON object on stdout")
    replay.add_argument(
        "--rank",
        type=int,
        metavar="R",
        help="a distributed step: replay rank R's part alone (one process)",
    )
    replay.add_argument(
        "--by-sample",
        action="store_true",
        help="attribute the step to its samples: per-sample gradient, share, loss, mismatch",
    )
    replay.set_defaults(handler=_replay)

    incidents = sub.add_parser("incidents", help="incidents of a run")
    inc_sub = incidents.add_subparsers(dest="incidents_command", required=True, metavar="ACTION")
    listing = inc_sub.add_parser("list", parents=[common], help="list incidents")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_incidents_list)
    show = inc_sub.add_parser("show", parents=[common], help="one incident in full")
    show.add_argument("id", type=int, metavar="ID")
    show.add_argument("--json", action="store_true")
    show.add_argument(
        "--samples",
        type=non_negative(int),
        metavar="N",
        help="decoded completions to print (default: the run's [daemon] log_samples)",
    )
    show.add_argument("--by-sample", action="store_true", help="attribute its step to its samples")
    show.set_defaults(handler=_incidents_show)
    export = inc_sub.add_parser("export", parents=[common], help="batch + JSON to a new dir")
    export.add_argument("id", type=int, metavar="ID")
    export.add_argument("out_dir", metavar="DIR")
    export.add_argument(
        "--by-sample", action="store_true", help="also attribution.json (replay --by-sample)"
    )
    export.set_defaults(handler=_incidents_export)

    fsck = sub.add_parser(
        "fsck", parents=[common], help="verify the store, its blobs and checkpoints"
    )
    fsck.add_argument("--json", action="store_true")
    fsck.set_defaults(handler=_fsck)

    gc = sub.add_parser("gc", parents=[common], help="prune blobs and checkpoints to a budget")
    gc.add_argument("--budget-bytes", type=int, help="default: [forensics] retention_bytes")
    gc.add_argument("--dry-run", action="store_true")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(handler=_gc)


def _db_upgrade(args: argparse.Namespace) -> int:
    from grpod.forensics import Store

    store = Store(args.run_dir, args.store_url)
    try:
        head = store.upgrade()
    finally:
        store.close()
    print(f"store {store.label}: schema at revision {head}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from grpod.forensics.errors import ForensicsError

    if (args.incident is None) == (args.step is None):
        raise ForensicsError("give an INCIDENT_ID or --step N (exactly one)")
    run = _run_dir(args)  # before the engine's imports: a foreign run dir is refused at once
    run.check_inputs()  # a moved or changed model or task is named
    from grpod.daemon import distributed
    from grpod.forensics import replay

    if args.by_sample:
        from grpod.daemon.commands.attribution import by_sample

        if args.rank is not None or args.trace:
            raise ForensicsError("replay --by-sample: not with --rank or --trace")
        _attributable(args, run)
        return by_sample(args)
    progress = _ProgressBar() if sys.stderr.isatty() else None
    which = dict(step=args.step, incident_id=args.incident, store_url=args.store_url)
    if run.trainer() == "trl":  # recorded by grpod.integrations.trl: through TRL's own loss
        from grpod.integrations.trl_replay import replay as replay_trl

        if args.rank is not None or args.trace:
            raise ForensicsError("replay of a TRL step: --rank and --trace are not supported")
        progress = None
        result = replay_trl(args.run_dir, **which)
    else:
        result = replay(args.run_dir, **which, trace=args.trace, progress=progress, rank=args.rank)
    if distributed.world_size() > 1:  # under torchrun: every rank replayed its part
        if distributed.rank() != 0:
            distributed.leave(0, together=True)
        distributed.barrier()
    if progress is not None:
        progress.done()
    if args.json:
        print(json.dumps(result.to_dict()))
        return EXIT_OK if result.reproduced else EXIT_FAILURE
    where = (
        f"incident {args.incident}, step {result.step}" if args.incident else f"step {result.step}"
    )
    verdict = f"diverged at step {result.diverged_at}"
    if result.reproduced:
        exact = result.reproduced is True
        verdict = "reproduced" + ("" if exact else f" {result.reproduced}")
    print(f"{where}: {verdict} ({result.classification})")
    print(
        f"  from checkpoint step {result.checkpoint_step}, {result.steps_replayed} steps replayed; "
        f"recorded outcome {result.outcome}, verdict {result.verdict_action}"
    )
    if not result.reproduced:
        print(f"  first differing field: {result.field}")
    if result.note:
        print(f"  note: {result.note}")
    for line in result.context.get("notes", []):  # restored, or differing and named
        print(f"  {line}")
    for name in result.recorded:
        print(
            f"  {name:<13} recorded {result.recorded[name]!r:<24} "
            f"replayed {result.replayed.get(name)!r}"
        )
    if result.trace is not None:
        print(f"  micro chunk  valid(rec/rep)  {'loss_sum(rec)':<24} {'loss_sum(rep)':<24} counter")
        for row in result.trace:
            mark = "" if row["equal"] else "  <- differs"
            print(
                f"  {row['micro']:>5} {row['chunk']:>5}  "
                f"{row['recorded_valid_tokens']!s:>5}/{row['replayed_valid_tokens']!s:<7} "
                f"{row['recorded_loss_sum']!r:<24} {row['replayed_loss_sum']!r:<24} "
                f"{row['replayed_counter_after']}{mark}"
            )
    return EXIT_OK if result.reproduced else EXIT_FAILURE


def _incidents_list(args: argparse.Namespace) -> int:
    _run_dir(args)
    from grpod.forensics import list_incidents

    rows = list_incidents(args.run_dir, args.store_url)
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no incidents")
    for row in rows:
        what = row["guard"] or ", ".join(row["guards"]) or "-"
        what += f" {row['kind']}" if row["kind"] else ""
        print(
            f"{row['id']:>4}  steps {row['step']}-{row['last_step']:<6} {row['status']:<6} "
            f"{row['steps']:>5} affected, worst {row['worst_step']:<6} {row['action']:<5} "
            f"checkpoint {row['checkpoint_step']!s:<6} {what}"
        )
    return 0


def _incidents_show(args: argparse.Namespace) -> int:
    _attributable(args, _run_dir(args))
    from grpod.daemon.commands.attribution import incident_attribution, print_incident_attribution
    from grpod.forensics.incidents import incident_batch
    from grpod.guards.trend import evidence_lines

    detail, config, batch = incident_batch(args.run_dir, args.id, args.store_url)
    count = args.samples
    if count is None:
        count = int(config.get("daemon", {}).get("log_samples", 0))
    samples, note = _decoded(config, batch, count) if count > 0 else ([], "")
    examples = _examples(config, batch, detail["findings"])
    # `samples`: the attribution's ranking (stored, or computed now with --by-sample)
    detail = {**incident_attribution(args, detail), "completions": samples, "examples": examples}
    if args.json:
        print(json.dumps(detail))
        return 0
    print(
        f"incident {detail['id']}: step {detail['step']} {detail['action']} "
        f"({detail['outcome']}), run {detail['run_id']}, checkpoint {detail['checkpoint_step']}"
    )
    print(
        f"  episode {detail['status']}: steps {detail['step']}-{detail['last_step']} "
        f"({detail['steps']} with the finding), worst step {detail['worst_step']}"
    )
    for finding in detail["findings"]:
        what = " ".join(filter(None, (finding.get("guard"), finding.get("kind"))))
        print(f"  [{finding.get('action')}] {what}: {finding.get('message')}")
        for line in evidence_lines(finding.get("evidence") or {}):  # grpod/guards/trend.py
            print(f"      {line}")
    report = detail["report"]
    for name in ("loss", "valid_tokens", "expected_valid_tokens", "grad_norm", "reward_mean"):
        print(f"  {name:<22} {report.get(name)}")
    for rank in detail["ranks"]:  # a distributed step: each rank's slice of the blob
        print(
            f"  step {rank['step']} rank {rank['rank']:<3} valid_tokens "
            f"{rank['valid_tokens']:<6} expected {rank['expected_valid_tokens']:<6} "
            f"local_loss {rank['local_loss']!s:<24} micros {rank['num_micros']} "
            f"from {rank['first_micro']}"
        )
    print(f"  batch blob {detail['batch_digest']}")
    for sample in samples:
        parts = " ".join(f"{k}={v:g}" for k, v in sample["rewards"].items())
        print(
            f"  sample {sample['sample']} (group {sample['group']}) reward {sample['reward']:g}"
            + (f" ({parts})" if parts else "")
        )
        print(f"    prompt:     {sample['prompt']!r}")
        print(f"    completion: {sample['completion']!r}")
    for sample in examples:  # the samples a finding names as its evidence
        audits = " ".join(f"{k}={v:g}" for k, v in sample["audits"].items())
        print(f"  evidence sample {sample['sample']}: reward {sample['reward']:g} ({audits})")
        print(f"    prompt:     {sample['prompt']!r}")
        print(f"    completion: {sample['completion']!r}")
    if note:
        print(f"  note: {note}")
    print_incident_attribution(detail, SHOWN_ROWS)
    return 0


def _examples(config: dict[str, Any], batch: Any, findings: list[dict[str, Any]]) -> list:
    """The samples findings name in their evidence (`example_sample`: reward_hacking's
    highest trained reward with the lowest audit reward), decoded."""
    wanted = sorted(
        {
            int(f["evidence"]["example_sample"])
            for f in findings
            if "example_sample" in f.get("evidence", {})
        }
    )
    if not wanted:
        return []
    decoded, _ = _decoded(config, batch, max(wanted) + 1)
    return [decoded[i] for i in wanted if i < len(decoded)]


def _decoded(config: dict[str, Any], batch: Any, limit: int | None) -> tuple[list, str]:
    """A batch's first `limit` samples as text with the run's tokenizer, or ([], why not): a
    tokenizer that is gone must not hide the incident itself."""
    from grpod.engine import EngineConfig, EngineError
    from grpod.engine.grpo.samples import decode_samples, run_tokenizer

    try:
        engine = EngineConfig.model_validate(config.get("engine", {}))
        tokenizer = run_tokenizer(engine)
    except (EngineError, ValueError) as exc:
        return [], f"samples not decoded: {str(exc).splitlines()[0]}"
    return decode_samples(batch, tokenizer, engine.stop, limit), ""


def _incidents_export(args: argparse.Namespace) -> int:
    _attributable(args, _run_dir(args))
    from grpod.forensics import export_incident

    notes: list[str] = []

    def decode(batch: Any, config: dict[str, Any]) -> list[dict[str, Any]]:
        samples, note = _decoded(config, batch, None)
        notes.append(note)
        return samples

    out = export_incident(
        args.run_dir,
        args.id,
        args.out_dir,
        args.store_url,
        decode=decode,
        by_sample=args.by_sample,
    )
    print(f"incident {args.id}: exported to {out}")
    for note in filter(None, notes):
        print(f"note: {note}")
    return 0


def _fsck(args: argparse.Namespace) -> int:
    _run_dir(args)
    from grpod.forensics import fsck
    from grpod.forensics.ledger import coverage_line

    report = fsck(args.run_dir, args.store_url)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        for line in report.problems:
            print(f"problem: {line}")
        for line in report.notes:
            print(f"note: {line}")
        for line in report.warnings:
            print(f"warning: {line}")
        print(coverage_line(report.ledger))
        if report.resume and report.resume_step is not None:
            print(report.resume)
        state = "ok" if report.ok else f"{len(report.problems)} problems"
        print(
            f"fsck: {report.blobs_checked} blobs, {report.checkpoints_checked} checkpoints "
            f"checked, {state}"
        )
    return EXIT_OK if report.ok else EXIT_FAILURE


def _gc(args: argparse.Namespace) -> int:
    from grpod.forensics import gc
    from grpod.forensics.config import run_dir_config

    budget = args.budget_bytes
    if budget is None:
        budget = run_dir_config(args.run_dir).retention_bytes
    report = gc(args.run_dir, budget, store_url=args.store_url, dry_run=args.dry_run)
    out: dict[str, Any] = report.to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    verb = "would free" if args.dry_run else "freed"
    print(
        f"gc: {verb} {report.freed_bytes} bytes ({report.blobs_deleted} blobs, checkpoints "
        f"{report.checkpoints_deleted or '-'}), kept {report.kept_bytes} of budget {budget}"
    )
    if not out["within_budget"]:
        print("gc: still over budget: the rest is pinned by incidents or the newest checkpoint")
    return 0


def _attributable(args: argparse.Namespace, run: RunDir) -> None:
    """`--by-sample` re-runs grpod's own engine: a TRL run's steps are refused (one line)."""
    if args.by_sample and run.trainer() == "trl":
        from grpod.forensics import ForensicsError

        raise ForensicsError("--by-sample: a step of a TRL run is replayed through TRL only")


def _run_dir(args: argparse.Namespace) -> RunDir:
    """The run dir a reader names, as this grpod writes one (rundir.existing_run_dir). Called
    before the engine's imports (torch: seconds), so a foreign run dir is refused at once."""
    from grpod.daemon.rundir import existing_run_dir

    return existing_run_dir(args.run_dir, args.store_url)


class _ProgressBar:
    """A one-line progress bar on stderr (only built when stderr is a TTY)."""

    def __call__(self, done: int, total: int, step: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\rreplay [{bar}] {done}/{total} step {step}")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
