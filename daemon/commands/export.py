"""`grpod export [--run-dir D] [--step N] OUT`: a checkpoint's policy as a Hugging Face dir.

`AutoModelForCausalLM.from_pretrained(OUT)` loads it and `generate`s with it (safetensors,
the run's tokenizer and generation config); a LoRA run's adapters are merged into it, or
with `--adapter` written alone as a PEFT adapter directory (`PeftModel.from_pretrained`).
`--step N` picks the checkpoint whose cursor is N (the state after N steps); the default is
the latest one. Read-only on the run directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from grpod.daemon.commands.status import DEFAULT_RUN_DIR

if TYPE_CHECKING:
    from grpod.daemon.rundir import RunDir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory (%(default)s)")
    p.add_argument("--step", type=int, help="the checkpoint at this step (default: latest)")
    p.add_argument(
        "--adapter", action="store_true", help="LoRA runs: the PEFT adapter alone, not merged"
    )
    p.add_argument("out", metavar="OUT", help="new (or empty) output directory")
    p.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    from grpod.daemon.config import load_config
    from grpod.daemon.errors import ConfigError
    from grpod.daemon.rundir import existing_run_dir

    run = existing_run_dir(args.run_dir)  # store_url: config.toml's; before torch's import
    config = load_config(run.config_path)
    if config.engine.model != "tiny-qwen2":  # export reads the model dir, never the task
        run.check_inputs(under=config.engine.model)
    steps = checkpoint_steps(run)
    if not steps:
        raise ConfigError(f"run dir {run.path}: no checkpoint to export")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise ConfigError(
            f"--step {step}: no checkpoint at that step in {run.path} (have {_listing(steps)})"
        )
    from grpod.engine.state.export import export_pretrained

    out = export_pretrained(
        config.engine, run.checkpoint_path(step), Path(args.out), adapter=args.adapter
    )
    print(f"exported checkpoint step {step} of {run.path} to {out}")
    return 0


def checkpoint_steps(run: RunDir) -> list[int]:
    """Steps of the complete checkpoints in a run directory (a renamed-into-place dir has
    its state.json), ascending."""
    steps = []
    for path in (run.path / "checkpoints").glob("step-*"):
        if (path / "state.json").is_file() and path.name[5:].isdigit():
            steps.append(int(path.name[5:]))
    return sorted(steps)


def _listing(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[-8:]))
    return shown if len(steps) <= 8 else f"..., {shown}"
