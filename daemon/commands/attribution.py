"""`grpod replay --step N --by-sample`: a recorded step attributed to its samples.

Text: the step's gradient check, where a non-finite value was born, the samples that stand
out, one row per sample (ranked) and the prompt and completion of the top rows; `--json`:
`StepAttribution.to_dict()` (forensics/attribution.py). Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from grpod.daemon.exitcodes import EXIT_OK

SHOWN = 3  # top rows whose prompt and completion are printed

COLUMNS = (  # (field, title, width, format spec)
    ("index", "sample", 6, "d"),
    ("prompt_id", "prompt", 6, "d"),
    ("reward", "reward", 7, ".3g"),
    ("advantage", "adv", 7, ".3g"),
    ("completion_length", "len", 4, "d"),
    ("grad_norm", "grad_norm", 10, ".4g"),
    ("share", "share", 7, ".3f"),
    ("projection", "proj", 7, ".3f"),
    ("predicted_share", "pred", 6, ".3f"),
    ("excess", "excess", 7, ".3g"),
    ("loss", "loss", 10, ".3g"),
    ("max_abs_log_ratio", "|logratio|", 10, ".3g"),
    ("max_mismatch", "mismatch", 9, ".3g"),
)


def by_sample(args: argparse.Namespace) -> int:
    from grpod.forensics.attribution import attribute

    result = attribute(
        args.run_dir, step=args.step, incident_id=args.incident, store_url=args.store_url
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return EXIT_OK
    print_attribution(result.to_dict())
    return EXIT_OK


def incident_attribution(args: argparse.Namespace, detail: dict[str, Any]) -> dict[str, Any]:
    """`grpod incidents show`'s incident (`show_incident`): with `--by-sample` its step
    attributed now, in place of what the daemon stored (`samples`, `nonfinite`, and the whole
    `StepAttribution.to_dict()` as `attribution`)."""
    if not args.by_sample:
        return detail
    from grpod.forensics.attribution import attribute

    result = attribute(args.run_dir, incident_id=args.id, store_url=args.store_url).to_dict()
    extra = {"status": "done", "note": result["note"]}
    return {**detail, **_ranked(result), "attribution": {**result, **extra}}


def print_incident_attribution(detail: dict[str, Any], rows: int) -> None:
    """An incident's attribution as text (the first `rows` samples), or why there is none."""
    info = detail["attribution"]
    if info["status"] != "done":
        print(f"  attribution: {info['status']}: {info['note']}")
        return
    if "samples" not in info:  # stored by the daemon when the incident opened
        print("  attribution (computed by the daemon when the incident opened):")
    print_attribution({**info, **_ranked(detail)}, rows=rows)


def _ranked(result: dict[str, Any]) -> dict[str, Any]:
    return {"samples": result["samples"], "nonfinite": result["nonfinite"]}


def print_attribution(result: dict[str, Any], rows: int | None = None) -> None:
    """The text form of `result` (`StepAttribution.to_dict()`); `rows`: only the first that
    many sample rows."""
    faults = ", ".join(result["injected_faults"]) or "none"
    samples, nonfinite = result["samples"], result["nonfinite"]
    print(
        f"step {result['step']}: {len(samples)} samples attributed in "
        f"{result['seconds']:.2f} s (from checkpoint step {result['checkpoint_step']}, "
        f"{result['steps_replayed']} steps replayed; recorded outcome {result['outcome']}, "
        f"verdict {result['verdict_action']}; injected faults: {faults})"
    )
    exact = "bit-equal" if result["reproduced"] else "differs"
    print(
        f"  gradient: recorded norm {result['recorded_grad_norm']}, replayed "
        f"{result['replayed_grad_norm']} ({exact}); sum of the finite per-sample gradients "
        f"{result['sum_grad_norm']}, residual |sum g - G| / |G| {result['residual']}"
    )
    if nonfinite is not None:
        print(f"  non-finite: born at {nonfinite['text']}")
    out = ", ".join(str(i) for i in result["stands_out"]) or "none"
    print(f"  stands out: {out} ({result['rule']})")
    if result["note"]:
        print(f"  note: {result['note']}")
    print("  " + " ".join(f"{title:>{width}}" for _, title, width, _ in COLUMNS))
    for row in samples[:rows]:
        print("  " + " ".join(_cell(row[key], width, spec) for key, _, width, spec in COLUMNS))
    for rank, row in enumerate(samples[:SHOWN], 1):
        print(
            f"  #{rank} sample {row['index']} (prompt {row['prompt_id']}): "
            f"prompt {row['prompt']!r} completion {row['completion']!r}"
        )
    print(f"  prompt ids: {result['prompt_id_is']}")


def _cell(value: Any, width: int, spec: str) -> str:
    """One table cell: a number in `spec`, or what JSON keeps of the rest ("nan", None)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:>{width}{spec}}"
    return f"{'-' if value is None else value!s:>{width}}"
