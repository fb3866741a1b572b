"""grpod's vLLM temporary directories (the pushes', the tiny model's export, the socket's): made
0700, locked while their run lives, swept when their run was killed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpod.engine import Engine
from grpod.engine.rollout.rollout_vllm import ServedModel
from grpod.engine.rollout.sync_dir import (
    LOCK,
    MODEL_PREFIX,
    PREFIX,
    PREFIXES,
    SETTLE_SECONDS,
    SHM,
    OwnedDir,
    SyncDir,
    hold,
    sweep,
)
from tests.engine.helpers import config


def aged(lock: Path) -> None:
    """`lock` older than a run that has not locked it yet could be."""
    past = lock.stat().st_mtime - 2 * SETTLE_SECONDS
    os.utime(lock, (past, past))


def test_a_run_holds_its_directory_until_it_closes_it() -> None:
    own = SyncDir(need_bytes=1)
    try:
        assert own.path.name.startswith(PREFIX)
        assert stat.S_IMODE(own.path.stat().st_mode) == 0o700
        aged(own.path / LOCK)
        assert own.path not in sweep(own.path.parent)  # locked: its run is alive
        assert own.path.is_dir()
        with pytest.raises(BlockingIOError):
            hold(own.path / LOCK)
    finally:
        own.close()
    assert not own.path.exists()


@pytest.mark.parametrize("prefix", PREFIXES)
def test_the_directory_of_a_killed_run_is_swept_and_only_that(tmp_path: Path, prefix: str) -> None:
    killed, alive, old, young = (tmp_path / f"{prefix}{n}" for n in ("k", "a", "o", "y"))
    for d in (killed, alive, old, young):
        d.mkdir(mode=0o700)
    (killed / "parameters.region").write_bytes(b"\0" * 4096)
    other = tmp_path / "grpod-other-k"  # not one of grpod's vLLM directories
    other.mkdir()
    (other / LOCK).touch()
    aged(other / LOCK)
    # a real process takes the lock and is killed by SIGKILL: the kernel drops its lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from grpod.engine.rollout.sync_dir import hold\n"
            f"hold(Path({str(killed / LOCK)!r}))\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    held = hold(alive / LOCK)  # a live run's
    (young / LOCK).touch()  # made a moment ago: its owner may not have locked it yet
    for d in (killed, alive):
        aged(d / LOCK)
    try:
        assert sweep(tmp_path) == []  # the holder still lives
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        assert sweep(tmp_path) == [killed]
        assert not killed.exists()
        assert alive.is_dir() and young.is_dir()
        assert old.is_dir()  # no lock file: an older grpod's, left alone
        assert other.is_dir()
    finally:
        os.close(held)
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def test_a_killed_runs_model_export_is_swept_by_the_next_and_a_closed_one_is_gone(
    tmp_path: Path,
) -> None:
    """The built-in tiny model exported for vLLM (~4 MB a run): a run killed by SIGKILL leaves
    it; the next run's export (or socket, or pushes' directory) removes it."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from grpod.engine import Engine\n"
            "from grpod.engine.rollout.rollout_vllm import ServedModel\n"
            "from tests.engine.helpers import config\n"
            "cfg = config(rollout_backend='vllm-server')\n"
            "served = ServedModel(Engine(cfg).rollout_model, cfg, 16, 'cpu')\n"
            "print(served.path, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert child.stdout is not None
        export = Path(child.stdout.readline().strip())
        assert export.parent == tmp_path and export.name.startswith(MODEL_PREFIX)
        assert (export / "model.safetensors").is_file()
        assert stat.S_IMODE(export.stat().st_mode) == 0o700
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert export.is_dir()  # SIGKILL: nothing of the run removed it
    aged(export / LOCK)
    following = OwnedDir(MODEL_PREFIX, tmp_path)
    try:
        assert not export.exists()
        assert following.path.is_dir()
    finally:
        following.close()
    assert not following.path.exists()


def test_a_served_model_removes_its_export_when_closed(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = config(rollout_backend="vllm-server")
    served = ServedModel(Engine(cfg).rollout_model, cfg, 16, "cpu")
    assert served.path.parent == tmp_path and (served.path / "config.json").is_file()
    served.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(MODEL_PREFIX)]


def test_pushes_in_shared_memory_still_sweep_a_killed_runs_pushes_in_the_temp_dir(
    monkeypatch, tmp_path: Path
) -> None:
    """A run that fell back to the temporary directory and was killed: the next run's pushes
    go to /dev/shm and still remove its model-sized directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = tmp_path / f"{PREFIX}killed"
    killed.mkdir(mode=0o700)
    (killed / LOCK).touch()
    aged(killed / LOCK)
    own = SyncDir(need_bytes=1)
    try:
        assert own.path.parent == SHM
        assert not killed.exists()
    finally:
        own.close()


def test_a_forked_child_that_closes_its_copy_leaves_the_directory_and_the_lock() -> None:
    own = OwnedDir(MODEL_PREFIX)
    try:
        child = os.fork()
        if child == 0:  # the child's copy: its close (or its exit) must not remove the dir
            own.close()
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert own.path.is_dir()
        aged(own.path / LOCK)
        assert own.path not in sweep(own.path.parent)  # still locked: by this process
    finally:
        own.close()
    assert not own.path.exists()
