"""Where this process stands in a torchrun job: torchrun's environment, read in one place.

Outside torchrun every value is that of a one-process job (rank 0 of 1). The rank of an
initialised process group is `torch.distributed.get_rank()`; this is what torchrun said
before any group exists (the daemon's plan, its metrics directory, the engine's join).
"""

from __future__ import annotations

import os


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """The rank on this node (its GPU index under torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """How many of the job's ranks run on this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def group_rank() -> int:
    """This node's index in the job."""
    return int(os.environ.get("GROUP_RANK", "0"))


def launched() -> bool:
    """Whether torchrun (or another launcher that sets RANK) started this process."""
    return "RANK" in os.environ
