"""The shared-memory push's layout: regions, manifests, and where the parameters may live."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from grpod.engine.model.flat import flatten_parameters
from grpod.engine.rollout.shared_weights import COPIES, PARAMS, SharedWeights, in_memory, views


def test_a_manifest_entry_outside_its_region_is_refused() -> None:
    region = torch.arange(64, dtype=torch.uint8)
    ((name, tensor),) = views([region], [["w", "float32", [2, 2], 16, 0]])
    assert name == "w" and tensor.shape == (2, 2)
    assert tensor.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="outside 64"):
        views([region], [["w", "float32", [4, 4], 16, 0]])  # 64 bytes at 16
    with pytest.raises(ValueError, match="names region 1 of 1"):
        views([region], [["w", "float32", [2], 0, 1]])


def test_only_a_sync_dir_in_memory_takes_the_parameters(disk_dir: Path) -> None:
    assert in_memory(Path("/dev/shm"))
    assert not in_memory(Path("/proc"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    flatten_parameters(model)
    on_disk = SharedWeights(disk_dir)
    assert not on_disk.adopt(model)  # training there would write the disk
    pushed = on_disk.write(list(model.state_dict().items()))
    assert pushed["paths"][PARAMS] == "" and {e[4] for e in pushed["manifest"]} == {COPIES}
    on_disk.close()

    sync = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        shared = SharedWeights(sync)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert shared.adopt(model) and shared.adopt(model)  # once; then already there
        pushed = shared.write(list(model.state_dict().items()))
        assert pushed["paths"] == [str(sync / "parameters.region"), ""]
        assert {e[4] for e in pushed["manifest"]} == {PARAMS}
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        separate = torch.nn.Linear(4, 4)  # parameters in storages of their own: not moved
        assert not shared.adopt(separate)
        shared.close()
        assert list(sync.iterdir()) == []
    finally:
        shutil.rmtree(sync, ignore_errors=True)
