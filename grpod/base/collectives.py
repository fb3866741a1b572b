"""The max all-reduce every rank's decision goes through, written once for the packages.

The guards' verdicts and skips, the daemon's agreed stop and the engine's count of trunk
passes are each one small integer reduced with MAX, so that no rank takes a branch a peer
does not (a collective one rank skips hangs the others). Outside an initialised
torch.distributed process group each value is its own: rank 0 of a one-process job. The
rank a launcher announced before any group exists is `grpod.base.torchrun`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def initialized() -> bool:
    """Whether this process is in a torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in its group (0 when there is none)."""
    return dist.get_rank() if initialized() else 0


def comm_device() -> torch.device:
    """Where a collective's tensor lives: this rank's CUDA device under NCCL (which reduces
    device tensors only), the CPU under gloo. Needs an initialised group."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(value: int) -> int:
    """The max of `value` over every rank (an int64 all-reduce); `value` itself when
    torch.distributed is not up."""
    if not initialized():
        return value
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
