"""Checkpoints of `Stateful` objects (torch.distributed.checkpoint's protocol).

`save_checkpoint(path, {"engine": engine, "guards": policy})` writes each object's
`state_dict()`: its tensors to `<key>.safetensors`, one file per top-level key of a state's
dict (the engine's `model`, `optimizer`, `cursor`), everything else to `state.json`, where
each tensor is a reference into its file. The directory is written beside its final name and
renamed into place, so a reader sees a complete checkpoint or none. Nothing here knows which
objects it saves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from grpod.base.fileio import atomic_dir
from grpod.base.oneline import one_line
from grpod.engine.errors import EngineError

if TYPE_CHECKING:  # an annotation only: torch.distributed.checkpoint takes ~0.5 s to import
    from torch.distributed.checkpoint.stateful import Stateful

FORMAT = "grpod.checkpoint/2"
TENSOR = "__tensor__"  # {"__tensor__": "file.safetensors:key"}: a tensor in a file
ITEMS = "__items__"  # {"__items__": [[key, value], ...]}: a dict with non-string keys


def save_checkpoint(
    path: str | os.PathLike, states: dict[str, Stateful], extra: dict[str, Any] | None = None
) -> Path:
    """Write every object of `states` to directory `path` atomically; `extra` is JSON."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    tree = {name: _encode_state(name, state.state_dict(), files) for name, state in states.items()}
    final = Path(path)
    with atomic_dir(final, replace=True) as tmp:
        for file, tensors in files.items():
            save_file(tensors, str(tmp / file))
        state = {"format": FORMAT, "states": tree, "extra": extra or {}}
        (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, default=_lambda_free))
    return final


def load_checkpoint(path: str | os.PathLike, states: dict[str, Stateful]) -> dict[str, Any]:
    """Restore every object of `states` from directory `path`; returns the extra state."""
    where = Path(path)
    if not (where / "state.json").is_file():
        raise EngineError(f"checkpoint {where}: missing state.json")
    try:
        state = json.loads((where / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"checkpoint {where}: unreadable state.json: {exc}") from None
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT:
        raise EngineError(f"checkpoint {where}: format {found!r}, not {FORMAT}")
    saved = state.get("states", {})
    missing = sorted(set(states) - set(saved))
    if missing:
        raise EngineError(f"checkpoint {where}: holds no {', '.join(missing)} state")
    needed = sorted({f for name in states for f in _files(saved[name])})
    for file in needed:
        if not (where / file).is_file():
            raise EngineError(f"checkpoint {where}: missing {file}")
    try:
        tensors = {file: load_file(str(where / file)) for file in needed}
    except Exception as exc:  # safetensors raises bare errors on truncated files
        raise EngineError(f"checkpoint {where}: unreadable: {exc}") from None
    for name, obj in states.items():
        try:
            obj.load_state_dict(_decode(saved[name], tensors))
        except EngineError as exc:
            raise EngineError(f"checkpoint {where}: {name}: {exc}") from None
    return state.get("extra", {})


def _encode_state(
    name: str, state: dict[str, Any], files: dict[str, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        file = f"{key}.safetensors"
        if file in files:
            raise EngineError(f"checkpoint: state {name!r} key {key!r}: {file} is taken")
        tensors: dict[str, torch.Tensor] = {}
        out[key] = _encode(value, file, [], tensors)
        if tensors:
            files[file] = tensors
    return out


def _encode(value: Any, file: str, at: list[str], tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for `value`, its tensors moved to `tensors` under their '/'-joined path."""
    if torch.is_tensor(value):
        key = "/".join(at)
        # a copy: parameters share one storage, which safetensors refuses to write
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR: f"{file}:{key}"}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, file, [*at, k], tensors) for k, v in value.items()}
        return {ITEMS: [[k, _encode(v, file, [*at, str(k)], tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_encode(v, file, [*at, str(i)], tensors) for i, v in enumerate(value)]
    return value


def _decode(value: Any, tensors: dict[str, dict[str, torch.Tensor]]) -> Any:
    if isinstance(value, dict):
        if TENSOR in value:
            file, key = value[TENSOR].split(":", 1)
            if key not in tensors[file]:
                raise EngineError(f"{file} holds no tensor {key!r}")
            return tensors[file][key]
        if ITEMS in value:
            return {k: _decode(v, tensors) for k, v in value[ITEMS]}
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def _files(value: Any) -> set[str]:
    """The tensor files a saved state refers to."""
    if isinstance(value, dict):
        if TENSOR in value:
            return {value[TENSOR].split(":", 1)[0]}
        return set().union(*map(_files, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(_files, value)) if value else set()
    return set()


def _lambda_free(value: Any) -> Any:
    return None  # LambdaLR keeps its lambdas out of state_dict; anything else unknown is dropped


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What keeps `load_checkpoint` from restoring directory `path` completely, without
    loading a tensor: state.json parses and has this format; every file it refers to exists;
    every safetensors file there is complete (its header parses, its data ends exactly at the
    end of the file) and holds every tensor referred to. Empty = complete."""
    where = Path(path)
    if not where.is_dir():
        return ["missing"]
    try:
        state = json.loads((where / "state.json").read_text())
    except FileNotFoundError:
        return ["no state.json"]
    except (OSError, ValueError) as exc:
        return [f"state.json unreadable: {one_line(exc, with_type=False)}"]
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT:
        return [f"state.json: format {found!r}, not {FORMAT}"]
    wanted: dict[str, set[str]] = {}
    _references(state.get("states", {}), wanted)
    for present in where.glob("*.safetensors"):  # a file there but not referred to: whole too
        wanted.setdefault(present.name, set())
    problems = []
    for file in sorted(wanted):
        keys, why = safetensors_keys(where / file)
        if why:
            problems.append(f"{file}: {why}")
        elif wanted[file] - keys:
            problems.append(f"{file}: holds no tensor {sorted(wanted[file] - keys)[0]!r}")
    return problems


def safetensors_keys(path: Path) -> tuple[set[str], str]:
    """(the tensor names of safetensors file `path`, "") or (set(), why it is not complete)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                return set(), f"truncated ({size} bytes, no complete header)"
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return set(), "missing"
    except (OSError, ValueError) as exc:
        return set(), f"unreadable header: {one_line(exc, with_type=False)}"
    if not isinstance(header, dict):
        return set(), "unreadable header: not a JSON object"
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return set(), "unreadable header: a tensor without data_offsets"
    if 8 + length + end != size:
        return set(), f"truncated ({size} bytes, its header says {8 + length + end})"
    return set(tensors), ""


def _references(value: Any, out: dict[str, set[str]]) -> None:
    """{file: tensor keys} a saved state refers to."""
    if isinstance(value, dict):
        if TENSOR in value:
            file, key = str(value[TENSOR]).split(":", 1)
            out.setdefault(file, set()).add(key)
            return
        for v in value.values():
            _references(v, out)
    elif isinstance(value, list):
        for v in value:
            _references(v, out)
