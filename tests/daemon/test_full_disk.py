"""A disk that fills mid-run, on a real tmpfs: `grpod run` exits 1 (the table's failure: not
the input's) with one line and no traceback; once there is room the next start resumes from a
complete checkpoint and fsck finds nothing half-written. `grpod export` onto a full disk:
one line, exit 1, no partial output directory."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import Grpod, cli, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_mid_run_is_one_line_and_resumes_whole(tmp_path: Path, tmpfs: Path) -> None:
    # a checkpoint is ~12 MB (weights and AdamW moments): the disk fills at the second one
    config = tiny_config(tmp_path / "grpod.toml", 0, metrics=False, state_digest_on_exit=False)
    run = Grpod(["--config", str(config), "--run-dir", str(tmpfs / "run")], tmp_path)
    assert run.wait() == 1
    (line,) = run.stderr.splitlines()
    assert line.startswith("grpod run: error: failed at step ") and "No space left" in line
    failed = run.event("failed")
    assert "No space left" in failed["error"]
    subprocess.run(["mount", "-o", "remount,size=200m", str(tmpfs)], check=True)
    leftovers = [p.name for p in tmpfs.rglob(".*tmp-*")]
    resumed = Grpod(["--run-dir", str(tmpfs / "run"), "--max-steps", "6"], tmp_path)
    assert resumed.wait() == 0, resumed.stderr
    assert resumed.event("started")["resumed_from"] is not None
    assert not list(tmpfs.rglob(".*tmp-*")), leftovers  # removed at the start
    check = cli("fsck", "--run-dir", str(tmpfs / "run"), cwd=tmp_path)
    assert check.returncode == 0, check.stdout
    assert "resume would restore checkpoint step 6" in check.stdout
    # export onto a disk with room for the config but not the weights
    out = tmp_path / "small"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], check=True)
    try:
        done = cli("export", "--run-dir", str(tmpfs / "run"), str(out / "hf"), cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("grpod export: error: ") and "No space left" in line
        assert not (out / "hf").exists() and not list(out.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)
