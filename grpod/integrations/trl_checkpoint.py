"""grpod's files in a TRL checkpoint directory: the guards' state, and a manifest for fsck.

TRL's `checkpoint-N/` (model, optimizer, scheduler, RNG, trainer state) is the state before
grpod step N. Beside it: `grpod_guards.json` (the guards' windows and counters, restored on
`train(resume_from_checkpoint=...)`) and a `state.json` in grpod's checkpoint format that
names every tensor of `model.safetensors`, so `grpod fsck` checks that the weights file is
complete (engine/state/checkpoint.py `checkpoint_problems`) as it checks grpod's own checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from grpod.base.fileio import write_atomic
from grpod.engine.state.checkpoint import FORMAT, TENSOR
from grpod.guards.policy import GuardPolicy

GUARDS_FILE = "grpod_guards.json"
WEIGHTS = "model.safetensors"


def write_manifest(folder: str | os.PathLike, policy: GuardPolicy, step: int) -> None:
    """Write the guards' state and the manifest into TRL's checkpoint `folder`."""
    where = Path(folder)
    write_atomic(where / GUARDS_FILE, json.dumps(policy.state_dict(), sort_keys=True))
    model = {}
    if (where / WEIGHTS).is_file():
        with safe_open(str(where / WEIGHTS), framework="pt") as fh:
            model = {key: {TENSOR: f"{WEIGHTS}:{key}"} for key in fh.keys()}  # noqa: SIM118
    state = {
        "format": FORMAT,
        "states": {"trl": {"model": model}},
        "extra": {"trainer": "trl", "global_step": step},
    }
    write_atomic(where / "state.json", json.dumps(state, sort_keys=True))


def load_guards(policy: GuardPolicy, folder: str | os.PathLike) -> None:
    """Restore the guards' state saved beside TRL's checkpoint (none saved: fresh guards)."""
    path = Path(folder) / GUARDS_FILE
    if path.is_file():
        policy.load_state_dict(json.loads(path.read_text()))
