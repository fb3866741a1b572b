"""The engine's state as `torch.distributed.checkpoint` and `engine/state/checkpoint.py` take it:
weights, AdamW state, LR schedule position and data cursor; and its sha256 digest."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from grpod.base.collectives import local
from grpod.engine.errors import EngineError
from grpod.engine.state.cursor import DataCursor

KEYS = ("model", "optimizer", "scheduler", "cursor")


def state_dict(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    cursor: DataCursor,
    *,
    fqn: bool,
) -> dict[str, Any]:
    """Plain tensors and dicts; `fqn`: model and optimizer in torch.distributed.checkpoint's
    form (`get_state_dict`), else the trained parameters and the optimizer's own form."""
    if fqn:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, optim = get_state_dict(model, optimizer)
    else:
        weights = {name: p.detach() for name, p in trained_parameters(model)}
        optim = optimizer.state_dict()
    return {
        "model": weights,
        "optimizer": optim,
        "scheduler": schedule.state_dict(),
        "cursor": cursor.state_dict(),
    }


def load_state_dict(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    cursor: DataCursor,
) -> None:
    """Restore `state_dict()`'s output; a state that does not fit is an EngineError."""
    missing = sorted(set(KEYS) - set(state))
    if missing:
        raise EngineError(f"engine state: missing {', '.join(missing)}")
    if _fqn_form(state["optimizer"]):  # DCP's form: resharded onto this engine's layout
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    else:
        _load_weights(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict({**state["scheduler"], "lr_lambdas": [None]})
    cursor.load_state_dict(state["cursor"])
    optimizer.zero_grad(set_to_none=True)


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """What a checkpoint holds of the model: every trainable parameter (all of them, or
    with LoRA only the adapters: the frozen base is the model directory's)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def state_digest(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> str:
    """sha256 over weights, optimizer state and the LR schedule position."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_tensor_bytes(tensor))
    opt = optimizer.state_dict()
    for index in sorted(opt["state"]):
        for key, value in sorted(opt["state"][index].items()):
            h.update(f"{index}.{key}".encode())
            h.update(_tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode())
    h.update(f"schedule:{schedule.last_epoch}".encode())
    return h.hexdigest()


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(trained_parameters(model))
    if set(weights) != set(params):
        raise EngineError("weights do not match the model's parameters")
    for name, tensor in weights.items():
        if tensor.shape != params[name].shape:
            raise EngineError(
                f"{name} has shape {tuple(tensor.shape)}, model has {tuple(params[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def _fqn_form(optimizer: dict[str, Any]) -> bool:
    """An optimizer state dict keyed by parameter names (`get_state_dict`), not indices."""
    groups = optimizer.get("param_groups") or [{}]
    return any(isinstance(p, str) for p in groups[0].get("params", ()))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    t = local(tensor.detach()).contiguous().cpu()  # a sharded model: this rank's shard
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
