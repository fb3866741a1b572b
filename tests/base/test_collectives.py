"""grpod.base.collectives: the max all-reduce, outside a process group and in a one-rank gloo one
(two ranks: tests/guards/test_distributed.py, tests/engine/model/test_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from grpod.base import collectives


def test_outside_a_group_each_value_is_its_own() -> None:
    assert not collectives.initialized()
    assert collectives.rank() == 0
    assert collectives.all_reduce_max(3) == 3 and collectives.all_reduce_max(0) == 0


def test_in_a_gloo_group_the_reduction_is_an_int_on_the_cpu(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert collectives.initialized() and collectives.rank() == 0
        assert collectives.comm_device() == torch.device("cpu")
        got = collectives.all_reduce_max(True)  # a bool flag comes back as its int
        assert got == 1 and type(got) is int
        assert collectives.all_reduce_max(2**40) == 2**40  # int64, not a float32 round
    finally:
        dist.destroy_process_group()
    assert not collectives.initialized()
