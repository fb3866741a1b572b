"""Atomic writes: build beside the final name, fsync, rename into place, fsync the directory.

A reader (or a process started after a crash) sees the old content or the new, never half of
it. The temporary name is `.<name>.tmp-<pid>`: hidden, and attributable to the process that
left it. `fsync` is the piece, for writers that batch it (the blob store publishes a group of
staged files with one directory fsync).

`file_sha256` reads a file's digest back in blocks (a model or a checkpoint need not fit in
memory).

`private_umask` is where the modes of everything grpod writes come from: at most
group-readable (0750 / 0640), whatever the shell's umask (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_UMASK = 0o027  # no write for the group, nothing for others


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of the file at `path`, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def private_umask() -> int:
    """Add `PRIVATE_UMASK` to this process's umask (a stricter one is kept); the new umask.
    Files and directories this process and its children create are at most 0640 / 0750."""
    umask = os.umask(PRIVATE_UMASK) | PRIVATE_UMASK
    os.umask(umask)
    return umask


def temp_path(path: str | os.PathLike) -> Path:
    """Where `path` is built before it is renamed into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync(path: str | os.PathLike) -> None:
    """Put a file's bytes, or a directory's entries (a rename or a new file in it), on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield the temporary path to write `path` through; on success it replaces `path`
    (fsynced first, and the directory after, when `durable`); on failure it is removed."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        yield tmp
        if durable:
            fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync(final.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = True) -> None:
    """Replace file `path` with `data` (text as UTF-8) atomically."""
    with atomic_file(path, durable=durable) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


@contextmanager
def atomic_dir(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory to fill; on success every file in it is fsynced and
    it is renamed to `path` (over an empty directory; over any existing one when `replace`),
    then the parent is fsynced. On failure it is removed."""
    final = Path(path)
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)  # a previous process with our pid left it
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for entry in [*tmp.rglob("*"), tmp]:  # every file's bytes, every directory's names
            if entry.is_file() or entry.is_dir():
                fsync(entry)
        if replace and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(final.parent)
