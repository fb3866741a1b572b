"""All-reduce (max) of a small integer so every rank applies, flushes or skips the same step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_max(value: int) -> int:
    """The max of `value` over every rank; `value` itself when torch.distributed is not up."""
    if not initialized():
        return value
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def rank() -> int:
    return dist.get_rank() if initialized() else 0
