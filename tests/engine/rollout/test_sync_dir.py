"""The push directory: made 0700, locked while its run lives, swept when its run was killed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grpod.engine.rollout.sync_dir import LOCK, PREFIX, SETTLE_SECONDS, SyncDir, hold, sweep


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


def test_the_directory_of_a_killed_run_is_swept_and_only_that(tmp_path: Path) -> None:
    killed, alive, old, young = (tmp_path / f"{PREFIX}{n}" for n in ("k", "a", "o", "y"))
    for d in (killed, alive, old, young):
        d.mkdir(mode=0o700)
    (killed / "parameters.region").write_bytes(b"\0" * 4096)
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
    finally:
        os.close(held)
        if holder.poll() is None:
            holder.kill()
        holder.wait()
