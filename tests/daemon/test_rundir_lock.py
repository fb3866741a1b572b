"""One live `grpod run` per run directory (flock; PostgreSQL advisory lock); readers still work."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from grpod.daemon.lock import RunDirLock
from grpod.forensics.errors import ForensicsError
from grpod.forensics.store import Store
from tests.daemon.helpers import Grpod, cli, free_port, tiny_config

pytestmark = pytest.mark.slow


def test_a_second_run_on_a_live_run_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "grpod.toml", free_port())
    run_dir = tmp_path / "run"
    first = Grpod(["--config", str(config), "--run-dir", str(run_dir)], tmp_path)
    try:
        first.wait_step(2)
        other = tiny_config(tmp_path / "other.toml", free_port())
        second = cli("run", "--config", str(other), "--run-dir", str(run_dir), cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert f"in use by grpod run pid {first.proc.pid}" in second.stderr
        for reader in (["status"], ["fsck"]):  # readers never take the lock
            done = cli(*reader, "--run-dir", str(run_dir), cwd=tmp_path)
            assert done.returncode == 0, (reader, done.stdout, done.stderr)
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    # the kernel dropped the dead holder's lock: the next owner takes it at once
    RunDirLock.acquire(run_dir).release()


def test_a_fresh_run_dir_is_locked_before_it_has_its_name(tmp_path: Path) -> None:
    from grpod.daemon.errors import ConfigError
    from grpod.daemon.rundir import RunDir

    first = RunDir(tmp_path / "run")
    from grpod.daemon.config import GrpodConfig

    first.create("run-a", GrpodConfig())
    assert first.held is not None
    second = RunDir(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"in use by grpod run pid {os.getpid()}"):
        second.create("run-b", GrpodConfig())
    first.held.release()
    second.lock()


@pytest.mark.postgres
def test_postgres_store_holds_an_advisory_lock_per_run_dir(tmp_path: Path) -> None:
    url = os.environ.get("GRPOD_TEST_PG_URL")
    if not url:
        pytest.skip("GRPOD_TEST_PG_URL not set (make test starts the server)")
    first, second = Store(tmp_path, url), Store(tmp_path, url)
    other = Store(tmp_path / "elsewhere", url)
    try:
        first.lock_run_dir()
        other.lock_run_dir()  # another run dir: its own lock
        with pytest.raises(ForensicsError, match="locked by another grpod run"):
            second.lock_run_dir()
        first.close()  # the session ends: the lock goes with it
        second.lock_run_dir()
    finally:
        for store in (first, second, other):
            store.close()
