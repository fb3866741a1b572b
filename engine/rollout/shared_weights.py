"""In-place weight pushes to the vLLM server through shared memory (`vllm_server_push`).

Both sides of one transfer, in one module so that the layout is written down once:

- **The trainer** (`SharedWeights`) keeps one region file in the push's 0700 sync directory
  (in /dev/shm, a tmpfs, when it has room: `rollout_server.sync_dir_for`), mode 0600, mapped
  shared. A push copies every tensor of the push into its slot (64-byte aligned, in the
  order `weights_to_push` gives them; a tied head is written under both of its names, as a
  snapshot stores it), then asks the server to load the region (`/collective_rpc`, method
  `grpod_load_shared`) with a manifest of names, dtypes, shapes and offsets. Nothing is
  written to a disk, serialized, or read back by the trainer; the region is made once and
  rewritten in place by every push of the same layout.
- **The server** (`SharedWeightsWorker`, given to vLLM as `--worker-extension-cls`: vLLM
  mixes it into its worker class) maps the same file once and hands vLLM's own in-place
  reload (`reload_weights(weights_iterator=...)`, the colocated sampler's path) views of it:
  the one copy is vLLM's, into its parameters, with its own name mapping (fused q/k/v,
  gate/up) and post-load processing. It answers with the parameters the reload did not
  load (`reload_attested`), which the weight-sync check fails on.

The server must run on this host and be able to import `grpod` (grpod's own server is
started from an environment that has it). A push is synchronous: the trainer rewrites the
region only after the previous load has returned, and never while a rollout is in flight
(`engine/rollout/sampling.py` drains first). The weight-sync check verifies what was
loaded, as for a snapshot.

On a GPU the same route stages through host memory (a device-to-host copy into the region,
host-to-device into vLLM's parameters); vLLM's NCCL / CUDA-IPC weight transfer is not wired
here (docs: README, "vLLM").
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

RPC_METHOD = "grpod_load_shared"
ALIGN = 64  # bytes: every slot starts on a cache line, and any dtype's view is aligned


def slots(weights: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """The manifest of a push: `[name, dtype, shape, offset]` for each tensor, in order."""
    manifest: list[list[Any]] = []
    offset = 0
    for name, tensor in weights:
        dtype = str(tensor.dtype).removeprefix("torch.")
        manifest.append([name, dtype, list(tensor.shape), offset])
        offset += _padded(tensor.numel() * tensor.element_size())
    return manifest


def region_bytes(manifest: list[list[Any]]) -> int:
    """The region's size for `manifest` (at least one slot's alignment)."""
    if not manifest:
        return ALIGN
    _, dtype, shape, offset = manifest[-1]
    return offset + _padded(math.prod(shape) * _dtype(dtype).itemsize)


def views(region: torch.Tensor, manifest: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    """Each slot of `region` (a uint8 tensor) as the tensor the manifest names."""
    out = []
    for name, dtype, shape, offset in manifest:
        torch_dtype = _dtype(dtype)
        flat = region[offset : offset + math.prod(shape) * torch_dtype.itemsize]
        out.append((name, flat.view(torch_dtype).view(shape)))
    return out


class SharedWeights:
    """The trainer's side: one shared region in `sync_dir`, rewritten by every push."""

    def __init__(self, sync_dir: Path) -> None:
        self.sync_dir = sync_dir
        self.path: Path | None = None  # named anew with every layout: a server maps by path
        self._generation = 0
        self._manifest: list[list[Any]] | None = None
        self._region: torch.Tensor | None = None

    def write(self, weights: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
        """Copy `weights` into the region (made, or made anew, when the layout changes);
        returns the manifest the server loads it by."""
        manifest = slots(weights)
        if manifest != self._manifest:
            self._map(region_bytes(manifest))
            self._manifest = manifest
        assert self._region is not None
        with torch.no_grad():
            for (_, tensor), (_, slot) in zip(weights, views(self._region, manifest)):
                slot.copy_(tensor)
        return manifest

    def close(self) -> None:
        """Unmap and remove the region."""
        self._region, self._manifest = None, None
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _map(self, size: int) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)  # the server's mapping keeps it until it remaps
        self._generation += 1
        self.path = self.sync_dir / f"weights-{self._generation:04d}.region"
        self.path.unlink(missing_ok=True)  # a previous process's, in a given sync dir
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._region = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)


class SharedWeightsWorker:
    """vLLM's worker extension (`--worker-extension-cls`): `grpod_load_shared` loads a
    region the trainer wrote, in place, through vLLM's own reload."""

    def grpod_load_shared(self, path: str, manifest: list[list[Any]]) -> dict[str, Any]:
        """Load every tensor of `manifest` from the region at `path`; returns how many
        tensors and bytes were handed to vLLM, and the parameters it did not load."""
        size = region_bytes(manifest)
        mapped = getattr(self, "_grpod_region", None)
        if mapped is None or mapped[0] != path or mapped[1] != size:
            region = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            mapped = self._grpod_region = (path, size, region)
        weights = views(mapped[2], manifest)
        unloaded = reload_attested(self, weights)
        return {"tensors": len(weights), "bytes": size, "unloaded": unloaded}


def reload_attested(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """vLLM's in-place reload of `weights` on `worker` (a vLLM worker), and the names of the
    model's parameters it did not load: what its reload computes and only logs (a tensor
    left out of a push, or one under a name the model does not map, keeps its old values).
    Runs in vLLM's worker, from the server's extension or the colocated sampler's RPC."""
    if getattr(getattr(worker, "model_config", None), "quantization", None) is not None:
        # a quantized model has parameters (scales) that no checkpoint tensor names: vLLM's
        # own count skips them too, so a quantized server is not attested
        worker.reload_weights(weights_iterator=iter(weights))
        return []
    model = worker.model_runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    load_weights = model.load_weights

    def recording(named_weights: Any) -> Any:
        names = load_weights(named_weights)
        loaded.update(names or ())
        return names

    model.load_weights = recording  # an instance attribute over the method, for this reload
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    return sorted(expected - loaded)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: {name!r} is not a torch dtype")
    return dtype
