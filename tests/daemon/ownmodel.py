"""A user's own campaign on disk: a HF model directory, a JSONL task and a reward module in the
working directory (not on PYTHONPATH), and the grpod.toml that names them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.daemon.helpers import write_config

REWARDS = """import math


def first_char(prompt, completion, answer):
    return 1.0 if completion[:1] == answer[:1] else 0.0


def boom(prompt, completion, answer):
    raise RuntimeError("no reward today")


def text(prompt, completion, answer):
    return "1.0"


def nan(prompt, completion, answer):
    return math.nan
"""

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a in range(4) for b in range(4)]

ENGINE: dict[str, Any] = {
    "task": "train.jsonl",
    "reward": "myrewards:first_char",
    "prompts_per_step": 2,
    "group_size": 2,
    "micro_batch_rows": 2,
    "seq_len": 32,
    "max_new_tokens": 2,
    "threads": 1,
}


def user_campaign(cwd: Path, model: Path, **engine: Any) -> Path:
    """Write train.jsonl and myrewards.py into `cwd`; returns the path of grpod.toml."""
    (cwd / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (cwd / "myrewards.py").write_text(REWARDS)
    return write_config(
        cwd / "grpod.toml",
        {
            "engine": {**ENGINE, "model": str(model), **engine},
            "daemon": {"metrics": False, "log_format": "json", "checkpoint_every": 2},
        },
    )
