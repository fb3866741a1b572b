"""`grpod.base.fileio`: a write that fails leaves the old content and no temporary behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpod.base.fileio import atomic_dir, atomic_file, private_umask, write_atomic


def test_a_failed_file_write_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    write_atomic(path, "old\n")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    write_atomic(path, b"new\n", durable=False)
    assert path.read_bytes() == b"new\n"


def test_a_directory_appears_complete_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "step-00000002"
    with pytest.raises(OSError), atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"one")
    # without `replace`, only an empty directory is renamed over
    with pytest.raises(OSError), atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"two")
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"three")
    assert (final / "model.safetensors").read_bytes() == b"three"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_private_umask_adds_027_and_keeps_a_stricter_one() -> None:
    before = os.umask(0)
    try:
        assert private_umask() == 0o027
        os.umask(0o077)
        assert private_umask() == 0o077
        os.umask(0o002)
        assert private_umask() == 0o027
    finally:
        os.umask(before)
