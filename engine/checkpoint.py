"""Engine checkpoints: weights, AdamW state, schedule position, data cursor, extra JSON state.

A checkpoint is a directory written beside its final name and renamed into place, so a
reader sees a complete checkpoint or none. Tensors go to safetensors; scalars to JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from grpod.engine.batch import TransportBatch
from grpod.engine.errors import EngineError
from grpod.fileio import atomic_dir

if TYPE_CHECKING:
    from grpod.engine.trainer import Engine

FORMAT = "grpod.checkpoint/1"


def save_checkpoint(
    engine: Engine, path: str | os.PathLike, extra: dict[str, Any] | None = None
) -> Path:
    """Write `engine`'s full training state to directory `path` atomically."""
    if engine._pending is not None:
        raise EngineError(f"checkpoint {path}: step {engine._pending.step} is still pending")
    final = Path(path)
    with atomic_dir(final, replace=True) as tmp:
        weights = {
            n: p.detach().cpu().contiguous().clone() for n, p in engine.model.named_parameters()
        }
        save_file(weights, str(tmp / "model.safetensors"))
        opt = engine.optimizer.state_dict()
        tensors, scalars = {}, {}
        for index, state in opt["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{index}.{key}"] = value
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        if engine.rollout_cache is not None:
            engine.rollout_cache.save(tmp / "rollout_cache.safetensors")
        state = {
            "format": FORMAT,
            "step": engine.step,
            "config_digest": engine.config_digest,
            "param_groups": opt["param_groups"],
            "optimizer_scalars": scalars,
            "scheduler": engine.scheduler.state_dict(),
            "extra": extra or {},
        }
        (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, default=_lambda_free))
    return final


def load_checkpoint(engine: Engine, path: str | os.PathLike) -> dict[str, Any]:
    """Restore `engine` from directory `path`; returns the checkpoint's extra state."""
    where = Path(path)
    for name in ("state.json", "model.safetensors", "optimizer.safetensors"):
        if not (where / name).is_file():
            raise EngineError(f"checkpoint {where}: missing {name}")
    try:
        state = json.loads((where / "state.json").read_text())
        weights = load_file(str(where / "model.safetensors"))
        opt_tensors = load_file(str(where / "optimizer.safetensors"))
    except Exception as exc:
        raise EngineError(f"checkpoint {where}: unreadable: {exc}") from None
    if state.get("format") != FORMAT:
        raise EngineError(f"checkpoint {where}: format {state.get('format')!r}, not {FORMAT}")
    params = dict(engine.model.named_parameters())
    if set(weights) != set(params):
        raise EngineError(f"checkpoint {where}: weights do not match the model's parameters")
    with torch.no_grad():
        for name, tensor in weights.items():
            if tensor.shape != params[name].shape:
                raise EngineError(
                    f"checkpoint {where}: {name} has shape {tuple(tensor.shape)}, "
                    f"model has {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
    opt_state: dict[int, dict[str, Any]] = {}
    for key, tensor in opt_tensors.items():
        index, name = key.split(".", 1)
        opt_state.setdefault(int(index), {})[name] = tensor
    for key, value in state["optimizer_scalars"].items():
        index, name = key.split(".", 1)
        opt_state.setdefault(int(index), {})[name] = value
    engine.optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    engine.scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None]})
    engine.step = int(state["step"])
    cache = where / "rollout_cache.safetensors"
    engine.rollout_cache = TransportBatch.load(cache) if cache.exists() else None
    engine.optimizer.zero_grad(set_to_none=True)
    return state.get("extra", {})


def _lambda_free(value: Any) -> Any:
    return None  # LambdaLR keeps its lambdas out of state_dict; anything else unknown is dropped
