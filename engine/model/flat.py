"""One storage for all of a model's parameters, so that a whole-model reduction is one op.

`flatten_parameters` moves every parameter into a slot of a single 1-D buffer and makes the
parameter a view of its slot (`param.data = slot`): the Parameter objects, their names, ties
and `requires_grad` stay as they were, so optimizers, state dicts and checkpoints see the same
model. Each slot starts at a multiple of `ALIGN_BYTES` (a multiple of the CPU allocator's 64
bytes and of CUDA's 512), so every kernel sees the alignment a separate allocation would give
it and computes the same bits; the padding between slots is zeros that nothing writes.

The guards' weights check finds the shared storage and reduces it in one op instead of one per
parameter (what that saves per step: bench/README.md, "Monitoring and recording overhead").
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
