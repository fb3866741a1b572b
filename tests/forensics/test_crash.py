"""Crash safety: a writer SIGKILLed mid-write leaves no referenced partial blob; fsck passes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from grpod.forensics import BlobStore, Store, fsck, gc
from grpod.forensics.blobs import TEMP_PREFIX
from grpod.forensics.models import Blob, Step
from tests.forensics.campaign import stand_in_run_json

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[2]
GRPOD = str(Path(sys.executable).with_name("grpod"))


def stop_while_writing(child: subprocess.Popen, blob_dir: Path) -> None:
    """Freeze `child` (SIGSTOP) at a moment a blob's temp file exists: the file is being
    written and not yet renamed into place, and stays so while the child is stopped."""
    deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
    while True:
        os.kill(child.pid, signal.SIGSTOP)
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once it is stopped
        assert os.WIFSTOPPED(status), f"the writer ended: status {status}"
        if any(p.name.startswith(TEMP_PREFIX) for p in blob_dir.iterdir()):
            return
        assert time.monotonic() < deadline, "never saw a blob being written"
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.001)


def kill_writer_mid_write(run_dir: Path, run_id: str, delay_seconds: float | None) -> None:
    """SIGKILL a recording process after `delay_seconds` (anywhere: a fuzz of where it
    stops), or (None) stopped while a blob's temp file exists."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.forensics.crash_writer", str(run_dir), run_id],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while True:  # wait until the writer has committed something and is busy writing
            line = child.stdout.readline()
            assert line, "the writer exited early"
            if int(line.split()[1]) >= 2:
                break
        if delay_seconds is not None:
            time.sleep(delay_seconds)
        else:
            stop_while_writing(child, run_dir / "blobs" / "sha256")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_sigkill_mid_write_leaves_no_referenced_partial_blob(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    kill_writer_mid_write(run_dir, "first", None)  # while a blob file is half written
    kill_writer_mid_write(run_dir, "second", 0.3)  # the store recovers and takes more steps
    assert any(p.name.startswith(TEMP_PREFIX) for p in (run_dir / "blobs" / "sha256").iterdir())

    store = Store(run_dir, create=False)
    blobs = BlobStore(run_dir)
    with store.session() as session:
        steps = session.scalars(select(Step)).all()
        rows = set(session.scalars(select(Blob.sha256)))
    store.close()
    assert {s.run_id for s in steps} == {"first", "second"}
    assert {s.batch_digest for s in steps} <= rows  # every referenced blob has its row ...
    for digest in rows:
        blobs.verify(digest)  # ... and its complete, verified file

    stand_in_run_json(run_dir, "second")  # what `grpod run` writes beside the store
    out = subprocess.run([GRPOD, "fsck", "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout.splitlines()[-1]

    gc(run_dir, budget_bytes=1 << 40, grace_seconds=0)  # interrupted writes' leftovers go
    left = sorted(p.name for p in (run_dir / "blobs" / "sha256").iterdir())
    assert not any(name.startswith(TEMP_PREFIX) for name in left)
    assert set(left) == rows
    assert fsck(run_dir).ok
