"""What a run reads from outside its run directory, made independent of the working directory.

`grpod run` records the model, task and eval task as absolute paths and the directory reward
modules are imported from (`reward_path`: its working directory), so replay, export, plot and
incidents work from any directory, later, on another machine with the same paths. It records
the sha256 of each input file too (`input_digests`: the task files, the model directory's
config and tokenizer files; not the weights, which checkpoints hold for every step that
matters): a moved or changed input is then named with what changed instead of being used as
if it were the same. Copies were not chosen: a model directory is gigabytes and a task can be
too, and a silent stale copy is worse than a clear refusal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpod.base.fileio import file_sha256
from grpod.engine.config import BUILTIN_TASKS, EngineConfig
from grpod.engine.errors import EngineError

BUILTIN_MODEL = "tiny-qwen2"
MODEL_FILES = (  # what decides the architecture and the token ids
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def absolute(config: EngineConfig, cwd: str | os.PathLike | None = None) -> EngineConfig:
    """`config` with model, task and eval task as absolute paths and `reward_path` set."""
    base = Path(cwd or os.getcwd()).resolve()

    def resolve(value: str) -> str:
        return str((base / value).resolve()) if value and not Path(value).is_absolute() else value

    update = {"reward_path": config.reward_path or str(base)}
    if config.model != BUILTIN_MODEL:
        update["model"] = resolve(config.model)
    if config.task not in BUILTIN_TASKS:
        update["task"] = resolve(config.task)
    if config.eval_task and config.eval_task not in BUILTIN_TASKS:
        update["eval_task"] = resolve(config.eval_task)
    return config.model_copy(update=update)


def use_reward_path(config: EngineConfig) -> None:
    """Put the run's `reward_path` first on sys.path (reward modules import from there)."""
    if config.reward_path and config.reward_path not in sys.path:
        sys.path.insert(0, config.reward_path)


def without_reward_code(config: EngineConfig) -> EngineConfig:
    """`config` for a reader of a recorded run (replay): no reward module named in it is
    imported, and its `reward_path` is not put on sys.path. A run dir may be someone else's,
    and replay re-runs recorded batches, whose rewards are in them (docs/SECURITY.md)."""
    update = {"reward": "", "rewards": [], "reward_weights": [], "reward_path": ""}
    return config.model_copy(update=update)


def input_digests(config: EngineConfig) -> dict[str, str]:
    """{absolute file: sha256} of the task files and the model directory's small files."""
    files = []
    for task in (config.task, config.eval_task):
        if task and task not in BUILTIN_TASKS:
            files.append(Path(task))
    if config.model != BUILTIN_MODEL:
        files += [Path(config.model) / name for name in MODEL_FILES]
    return {str(f): file_sha256(f) for f in files if f.is_file()}


def check_inputs(recorded: dict[str, str], what: str) -> None:
    """EngineError naming the first recorded input that moved or changed since the run."""
    for file, digest in sorted(recorded.items()):
        path = Path(file)
        if not path.is_file():
            raise EngineError(f"{what}: {file} is gone (moved or removed since the run)")
        now = file_sha256(path)
        if now != digest:
            raise EngineError(
                f"{what}: {file} changed since the run (sha256 {digest[:12]}, now {now[:12]})"
            )
