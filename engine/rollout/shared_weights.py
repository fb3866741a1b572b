"""In-place weight pushes to the vLLM server through shared memory (`vllm_server_push`).

Both sides of one transfer, in one module so that the layout is written down once:

- **The trainer** (`SharedWeights`) keeps its tensors in region files in the push's 0700 sync
  directory (in /dev/shm, a tmpfs, when it has room: `engine/rollout/sync_dir.py`), mode
  0600, mapped shared. At the first push the rollout model's parameters move into a region of
  their own (`adopt`: the one storage `engine/model/flat.py` gives them, at the same offsets),
  so the server reads them where they are trained and a push copies none of them. A tensor
  that lives elsewhere (a drill's altered matrix, a buffer, every tensor when the sync
  directory is on a disk or the parameters do not share one storage) is copied into a second
  region, 64-byte aligned slots in push order, made anew when that layout changes. Then one
  RPC (`/collective_rpc`, method `grpod_load_shared`) asks the server to load the push from
  a manifest of names, dtypes, shapes, offsets and regions. Nothing is written to a disk,
  serialized, or read back by the trainer; a tied head is named twice, as a snapshot stores
  it (one slot).
- **The server** (`SharedWeightsWorker`, given to vLLM as `--worker-extension-cls`: vLLM
  mixes it into its worker class) maps each region once and hands vLLM's own in-place reload
  (`reload_weights(weights_iterator=...)`, the colocated sampler's path) views of them: the
  one copy is vLLM's, into its parameters, with its own name mapping (fused q/k/v, gate/up)
  and post-load processing. It answers with the parameters the reload did not load
  (`reload_attested`), which the weight-sync check fails on.

The server must run on this host and be able to import `grpod` (grpod's own server is
started from an environment that has it). The server reads the regions only inside the
RPC, and a push is synchronous: the trainer's next update (or a second region's rewrite)
comes after the load has returned, and no push lands while a rollout is in flight
(`engine/rollout/sampling.py` drains first). The weight-sync check verifies what was
loaded, as for a snapshot.

On a GPU the parameters stay on the device and every push copies them into the second
region (device-to-host; host-to-device into vLLM's parameters); vLLM's NCCL / CUDA-IPC
weight transfer is not wired here (docs: README, "vLLM").
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from grpod.engine.errors import EngineError
from grpod.engine.model.flat import move_parameters, parameter_bytes

RPC_METHOD = "grpod_load_shared"
ALIGN = 64  # bytes: every slot starts on a cache line, and any dtype's view is aligned
PARAMS, COPIES = 0, 1  # a manifest entry's region: the adopted parameters, or the copies
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}  # where training in a mapped file touches no disk


def slots(weights: list[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """The copies' layout: `[name, dtype, shape, offset]` for each tensor, in order."""
    manifest: list[list[Any]] = []
    offset = 0
    for name, tensor in weights:
        manifest.append([name, _dtype_name(tensor.dtype), list(tensor.shape), offset])
        offset += _padded(tensor.numel() * tensor.element_size())
    return manifest


def region_bytes(manifest: list[list[Any]]) -> int:
    """The copies region's size for `manifest` (at least one slot's alignment)."""
    if not manifest:
        return ALIGN
    _, dtype, shape, offset = manifest[-1]
    return offset + _padded(math.prod(shape) * _dtype(dtype).itemsize)


def views(regions: list[torch.Tensor], manifest: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    """Each entry of `manifest` (`[name, dtype, shape, offset, region]`) as the tensor it names
    in `regions` (uint8 tensors)."""
    out = []
    for name, dtype, shape, offset, region in manifest:
        if not 0 <= region < len(regions):
            raise ValueError(f"shared weights: {name} names region {region} of {len(regions)}")
        out.append((name, _view(regions[region], dtype, shape, offset)))
    return out


class Region:
    """One file in the sync directory, its pages reserved, mapped shared: `tensor` is a uint8
    view of its bytes. The file is removed by `close`; a mapping outlives it."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        path.unlink(missing_ok=True)  # a previous process's, in a given sync dir
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # no room: an error now, not SIGBUS on a write
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise EngineError(f"vllm_server_sync_dir {path.parent}: {size} bytes: {exc}") from None
        finally:
            os.close(fd)
        self.tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class SharedWeights:
    """The trainer's side: the adopted parameters' region and the copies' region in
    `sync_dir`; `write` gives a push's RPC arguments."""

    def __init__(self, sync_dir: Path) -> None:
        self.sync_dir = sync_dir
        self.params: Region | None = None  # the adopted model's parameters live here
        self.copies: Region | None = None  # named anew with every layout: a server maps by path
        self._generation = 0
        self._layout: list[list[Any]] | None = None

    def adopt(self, model: torch.nn.Module) -> bool:
        """Move `model`'s parameters into a region of their own (once; on a CPU, when they
        share one storage and the sync directory is in memory): from then on a push copies
        none of them. Returns whether they live there."""
        if self.params is not None:  # adopted: still there unless something moved them
            return self._offset(next(model.parameters())) is not None
        source = parameter_bytes(model)
        if source is None or source.device.type != "cpu" or not in_memory(self.sync_dir):
            return False
        self.params = Region(self.sync_dir / "parameters.region", source.numel())
        move_parameters(model, self.params.tensor)
        return True

    def write(self, weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """The RPC's arguments for pushing `weights`: `paths` (the regions) and `manifest`
        (`[name, dtype, shape, offset, region]` each, in order). A tensor in the adopted
        region is named where it lives; every other one is copied into the copies' region
        (made, or made anew, when their layout changes)."""
        manifest: list[list[Any] | None] = []
        copied: list[tuple[int, tuple[str, torch.Tensor]]] = []
        for i, (name, tensor) in enumerate(weights):
            offset = self._offset(tensor)
            if offset is None:
                copied.append((i, (name, tensor)))
                manifest.append(None)
            else:
                manifest.append(
                    [name, _dtype_name(tensor.dtype), list(tensor.shape), offset, PARAMS]
                )
        layout = slots([w for _, w in copied])
        if copied and layout != self._layout:
            self._map_copies(region_bytes(layout))
            self._layout = layout
        if copied:
            assert self.copies is not None
            region = self.copies.tensor
            with torch.no_grad():
                for (i, (_, tensor)), slot in zip(copied, layout):
                    manifest[i] = [*slot, COPIES]
                    _view(region, *slot[1:]).copy_(tensor)
        paths = [str(r.path) if r is not None else "" for r in (self.params, self.copies)]
        if not copied:
            paths[COPIES] = ""
        return {"paths": paths, "manifest": manifest}

    def close(self) -> None:
        """Remove the regions' files (the adopted parameters stay mapped where they are)."""
        for region in (self.params, self.copies):
            if region is not None:
                region.close()
        self.params, self.copies, self._layout = None, None, None

    def _offset(self, tensor: torch.Tensor) -> int | None:
        """Where `tensor` lies in the adopted region, or None when it lies elsewhere."""
        if self.params is None or not tensor.is_contiguous():
            return None
        base = self.params.tensor
        if tensor.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        return tensor.data_ptr() - base.data_ptr()

    def _map_copies(self, size: int) -> None:
        if self.copies is not None:
            self.copies.close()  # the server's mapping keeps it until it remaps
        self._generation += 1
        self.copies = Region(self.sync_dir / f"weights-{self._generation:04d}.region", size)


class SharedWeightsWorker:
    """vLLM's worker extension (`--worker-extension-cls`): `grpod_load_shared` loads a push
    the trainer wrote, in place, through vLLM's own reload."""

    def grpod_load_shared(self, paths: list[str], manifest: list[list[Any]]) -> dict[str, Any]:
        """Load every tensor of `manifest` from the regions at `paths` ('' for one the push
        does not use); returns how many tensors and bytes were handed to vLLM, and the
        parameters it did not load."""
        mapped: dict[str, torch.Tensor] = getattr(self, "_grpod_regions", {})
        regions = []
        for path in paths:
            size = os.path.getsize(path) if path else 0
            region = mapped.get(path)
            if path and (region is None or region.numel() != size):
                region = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            regions.append(region if path else torch.empty(0, dtype=torch.uint8))
        self._grpod_regions = {p: r for p, r in zip(paths, regions) if p}  # old ones unmapped
        weights = views(regions, manifest)
        unloaded = reload_attested(self, weights)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        return {"tensors": len(weights), "bytes": nbytes, "unloaded": unloaded}


def in_memory(path: Path) -> bool:
    """Whether `path` lies on a filesystem in memory (tmpfs, ramfs: /proc/self/mounts)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    target, best, kind = os.path.realpath(path), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in MEMORY_FILESYSTEMS


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


def _view(region: torch.Tensor, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    """The tensor of `dtype` and `shape` at byte `offset` of `region` (a uint8 tensor)."""
    torch_dtype = _dtype(dtype)
    nbytes = math.prod(shape) * torch_dtype.itemsize
    if offset < 0 or offset + nbytes > region.numel():
        raise ValueError(f"shared weights: {nbytes} bytes at {offset} outside {region.numel()}")
    return region[offset : offset + nbytes].view(torch_dtype).view(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: {name!r} is not a torch dtype")
    return dtype
