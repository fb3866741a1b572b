"""One storage for all of a model's parameters, so that a whole-model reduction is one op.

`flatten_parameters` moves every parameter into a slot of a single 1-D buffer and makes the
parameter a view of its slot (`param.data = slot`): the Parameter objects, their names, ties
and `requires_grad` stay as they were, so optimizers, state dicts and checkpoints see the same
model. Each slot starts at a multiple of `ALIGN_BYTES` (a multiple of the CPU allocator's 64
bytes and of CUDA's 512), so every kernel sees the alignment a separate allocation would give
it and computes the same bits; the padding between slots is zeros that nothing writes.

The guards' weights check finds the shared storage (`storage_cover`) and reduces it in one op
instead of one per parameter (what that saves per step: bench/README.md, "Monitoring and
recording overhead"). `move_parameters` moves a flattened model's storage somewhere else whole,
at the same offsets: grpod's vLLM server reads the rollout model's parameters from shared
memory where they are trained (engine/rollout/shared_weights.py).
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 512


def flatten_parameters(model: torch.nn.Module) -> torch.Tensor | None:
    """Re-home `model`'s parameters in one buffer; returns it, or None (nothing changed) when
    the parameters differ in dtype or device, or there are none."""
    # a tied parameter is listed once; matrices first, so that a layer's q/k/v (and gate/up)
    # weights lie back to back, not split by their biases: the fused decoder then views them
    # as one matrix (engine.model.fused.joined) instead of copying them for every rollout
    params = list(model.parameters())
    params = [p for p in params if p.dim() >= 2] + [p for p in params if p.dim() < 2]
    if not params:
        return None
    dtype, device = params[0].dtype, params[0].device
    if any(p.dtype != dtype or p.device != device for p in params):
        return None
    align = max(1, ALIGN_BYTES // params[0].element_size())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() // align) * align
    flat = torch.zeros(total, dtype=dtype, device=device)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            slot = flat[offset : offset + p.numel()].view(p.shape)
            slot.copy_(p)
            p.data = slot
    return flat


def storage_cover(params: list[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D tensor over the one storage that holds all of `params` (their dtype, every element
    of the storage), or None when they do not share one storage of one dtype."""
    if not params:
        return None
    first = params[0]
    storage = first.untyped_storage()
    ptr = storage.data_ptr()
    if any(p.dtype != first.dtype or p.untyped_storage().data_ptr() != ptr for p in params):
        return None
    cover = torch.empty(0, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        cover.set_(storage, 0, (storage.nbytes() // first.element_size(),))
    return cover


def parameter_bytes(model: torch.nn.Module) -> torch.Tensor | None:
    """A 1-D uint8 tensor over the one storage all of `model`'s parameters live in, each of
    them contiguous (a flattened model's), or None."""
    params = list(model.parameters())
    cover = storage_cover(params)
    if cover is None or not all(p.is_contiguous() for p in params):
        return None
    return cover.view(torch.uint8)


def move_parameters(model: torch.nn.Module, into: torch.Tensor) -> None:
    """Move a flattened model's parameters (one storage: `flatten_parameters`) into `into`, a
    1-D uint8 tensor of at least the storage's bytes, at the same byte offsets: the same
    Parameter objects (ties, optimizer state and layout kept), now views of `into`."""
    source = parameter_bytes(model)
    if source is None:
        raise ValueError("move_parameters: the parameters do not share one storage")
    if into.dtype != torch.uint8 or into.dim() != 1 or into.numel() < source.numel():
        raise ValueError(f"move_parameters: {source.numel()} bytes do not fit {tuple(into.shape)}")
    base = source.data_ptr()
    with torch.no_grad():
        into[: source.numel()].copy_(source)
        for p in model.parameters():
            start = p.data_ptr() - base
            nbytes = p.numel() * p.element_size()
            p.data = into[start : start + nbytes].view(p.dtype).view(p.shape)
