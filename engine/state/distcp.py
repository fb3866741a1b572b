"""Checkpoints of `Stateful` objects under torchrun, with `torch.distributed.checkpoint` (DCP).

`save(path, {"engine": engine, "guards": policy}, parallel)` is the one entry for every
checkpoint: one process writes `engine/state/checkpoint.py`'s format; a distributed engine (FSDP2
or DDP) writes one DCP directory collectively. There, the keys an object names in `DCP_KEYS`
(the engine's `model` and `optimizer`, in DCP's FQN form) go through `dcp.save`, each rank
its shards (DDP's replicated tensors: written once, by DCP's de-duplication); everything
else of every object is rank-local (data cursor, schedule, the guard windows of
`GuardPolicy.state_dict`) and goes to `rank-R/` in checkpoint.py's format. Rank 0
builds the directory beside its final name (`grpod.base.fileio.atomic_dir`) and renames it once
every rank is done, so a reader sees a complete checkpoint or none (a killed job leaves a
`.step-N.tmp-<pid>` directory, which start-up removes).

Resume with the same world size restores everything; with another world size DCP reshards
model and optimizer, every rank takes rank 0's rank-local state without its rollout cache,
and `restored` says so. A one-process engine (`grpod replay --rank R`) loads a DCP checkpoint
unsharded, and `load_model_weights` gives `grpod export` the consolidated weights.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpod.base import torchrun
from grpod.base.fileio import atomic_dir
from grpod.base.oneline import one_line
from grpod.engine.errors import EngineError
from grpod.engine.model.parallel import Parallel
from grpod.engine.state.checkpoint import checkpoint_problems, load_checkpoint, save_checkpoint

if TYPE_CHECKING:  # an annotation only: torch.distributed.checkpoint takes ~0.5 s to import
    from torch.distributed.checkpoint.stateful import Stateful

FORMAT = "grpod.dcp_checkpoint/2"


def save(
    path: str | os.PathLike,
    states: dict[str, Stateful],
    parallel: Parallel,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `states` to directory `path`; distributed: collective, every rank the same `path`.

    Replicas under torchrun (`parallel = "none"`: no process group) write rank 0's state
    only: every rank writing its own to the one directory raced (a rename onto the
    directory a peer had just published failed the step, else the last writer won), and a
    resume restores every replica from it. A replica's `parallel.rank` is 0 (it is a job of
    its own), so torchrun's rank decides which one writes."""
    if not parallel.distributed:
        if torchrun.rank() != 0:
            return Path(path)
        return save_checkpoint(path, states, extra)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final, rank = Path(path), parallel.rank
    shared, rest = {}, {}
    for name, obj in states.items():
        state, keys = obj.state_dict(), getattr(obj, "DCP_KEYS", ())
        shared[name] = {k: state[k] for k in keys}
        rest[name] = _Fixed({k: v for k, v in state.items() if k not in keys})
    with ExitStack() as stack:
        box: list[Any] = [None]
        if rank == 0:  # rank 0 owns the directory; the others write into its temporary
            box[0] = str(stack.enter_context(atomic_dir(final, replace=True)))
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        dcp.save(shared, checkpoint_id=str(tmp))
        save_checkpoint(tmp / f"rank-{rank}", rest, extra)
        dist.barrier()  # every rank's files are complete before rank 0 publishes
        if rank == 0:
            state = {"format": FORMAT, "world_size": parallel.world_size}
            (tmp / "state.json").write_text(json.dumps(state, sort_keys=True))
    dist.barrier()
    return final


def load(
    path: str | os.PathLike, states: dict[str, Stateful], parallel: Parallel
) -> dict[str, Any]:
    """Restore `states` from directory `path`; returns the extra state (a DCP checkpoint's
    with `restored`, what was kept, and `saved_world_size`)."""
    where = Path(path)
    if not is_dcp(where):
        if parallel.distributed:
            raise EngineError(f"checkpoint {where}: not a torch.distributed.checkpoint directory")
        return load_checkpoint(where, states)
    import torch.distributed.checkpoint as dcp

    try:
        state = json.loads((where / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"checkpoint {where}: unreadable state.json: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise EngineError(f"checkpoint {where}: format {found!r}, not {FORMAT}")
    shared = {}
    for name, obj in states.items():
        keys = getattr(obj, "DCP_KEYS", ())
        template = obj.state_dict(fqn=True) if keys else {}
        shared[name] = {k: template[k] for k in keys}
    try:
        dcp.load(shared, checkpoint_id=str(where))
    except _load_errors() as exc:  # DCP's CheckpointException is a BaseException
        raise EngineError(f"checkpoint {where}: cannot load: {_dcp_reason(exc)}") from None
    saved_world = int(state.get("world_size", 0))
    same = saved_world == parallel.world_size
    rest = {name: _Fixed({}) for name in states}
    extra = load_checkpoint(where / f"rank-{parallel.rank if same else 0}", rest)
    for name, obj in states.items():
        local = rest[name].state
        if not same and isinstance(local.get("cursor"), dict):
            local["cursor"]["rollout_cache"] = None  # rank 0's samples are not this rank's
        obj.load_state_dict({**local, **shared[name]})
    kept = "everything" if same else "model, optimizer, schedule, cursor; rank 0's guard state"
    return {**extra, "restored": kept, "saved_world_size": saved_world}


def load_model_weights(path: str | os.PathLike, params: dict[str, Any]) -> dict[str, Any]:
    """The full model weights named in `params` (name -> a tensor of the shape wanted) from a
    DCP checkpoint, in one process without a process group: the shards of every rank
    consolidated (what `grpod export` writes as one Hugging Face directory)."""
    import torch
    import torch.distributed.checkpoint as dcp

    weights = {name: torch.empty_like(tensor) for name, tensor in params.items()}
    try:
        dcp.load({"engine": {"model": weights}}, checkpoint_id=str(path))
    except _load_errors() as exc:  # DCP's CheckpointException is a BaseException
        raise EngineError(f"checkpoint {path}: cannot load: {_dcp_reason(exc)}") from None
    return weights


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a DCP load raises (read when one did: DCP is imported where it is used)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _dcp_reason(exc: BaseException) -> str:
    """A CheckpointException's first rank failure (its message is `ranks:dict_keys([0])`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = next(iter(sorted(failures.items())))
        cause = cause.exception if hasattr(cause, "exception") else cause
        return f"rank {rank}: {one_line(cause) if isinstance(cause, BaseException) else cause}"
    return one_line(exc)


def problems(path: str | os.PathLike) -> list[str]:
    """What keeps `load` from restoring checkpoint directory `path` (either format), checked
    without loading a tensor; empty = complete. For DCP: `.metadata` loads, every shard file it
    names exists and is as long as the metadata says, state.json has the format, and every
    rank's `rank-R/` checkpoint is complete."""
    where = Path(path)
    if not is_dcp(where):
        return checkpoint_problems(where)
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(where)).read_metadata()
    except _load_errors() as exc:
        return [f".metadata unreadable: {one_line(exc)}"]
    found: list[str] = []
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        file = where / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            found.append(f"{name}: missing")
        elif size < end:
            found.append(f"{name}: truncated ({size} bytes, .metadata says {end})")
    try:
        state = json.loads((where / "state.json").read_text())
    except (OSError, ValueError) as exc:
        return [*found, f"state.json unreadable: {one_line(exc, with_type=False)}"]
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return [*found, f"state.json: format not {FORMAT}"]
    for rank in range(int(state.get("world_size", 0))):
        found += [f"rank-{rank}/{p}" for p in checkpoint_problems(where / f"rank-{rank}")]
    return found


def is_dcp(path: str | os.PathLike) -> bool:
    """A DCP checkpoint directory (as `save` writes it under torchrun)."""
    return (Path(path) / ".metadata").is_file()


class _Fixed:
    """A `Stateful` holding one state dict: what a rank saves of its own, or has loaded."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
