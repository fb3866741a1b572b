"""The temporary directories grpod's vLLM paths make, and what a killed run left there: the
pushes' directory, the built-in tiny model exported for vLLM to load, the socket of grpod's own
server.

A push's shared regions or snapshots are as large as the model (engine/rollout/
shared_weights.py), and they live in /dev/shm when it has room. A run that exits removes its
directory; one killed by SIGKILL or the OOM killer cannot, and under systemd's
`Restart=on-failure` every failed start would leave a model's worth of /dev/shm behind until
the next pushes no longer fit there. So the run holds an exclusive `flock` on a file in its
directory for as long as it lives (the kernel drops it with the process, however it dies),
and a new run removes this user's directories whose lock nobody holds before it measures the
room. A lock is a kernel object, so this holds across PID namespaces that share /dev/shm; a
directory without a lock file (an older grpod's, or one being made) is left alone. The
tiny model's export (~4 MB) and the socket's directory are made and swept the same way.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
import weakref
from pathlib import Path

PREFIX = "grpod-vllm-sync-"  # the pushes
MODEL_PREFIX = "grpod-vllm-model-"  # the built-in tiny model, exported for vLLM to load
SOCKET_PREFIX = "grpod-vllm-socket-"  # grpod's own server's Unix socket
PREFIXES = (PREFIX, MODEL_PREFIX, SOCKET_PREFIX)
LOCK = "owner.lock"
SHM = Path("/dev/shm")
# a lock file younger than this may be one whose owner has not locked it yet
SETTLE_SECONDS = 60.0


class OwnedDir:
    """A new 0700 directory named `prefix`... in `where` (None: the temporary directory),
    locked by this process until `close` (or its collection, or the interpreter's exit),
    made after removing the directories of this user's runs that died there (`swept`: the
    caller has)."""

    def __init__(self, prefix: str, where: Path | None = None, *, swept: bool = False) -> None:
        if not swept:
            sweep(where or Path(tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
        try:
            lock = hold(self.path / LOCK)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _remove, self.path, lock, os.getpid())

    def close(self) -> None:
        """Remove the directory and drop its lock."""
        self._finalizer()


class SyncDir(OwnedDir):
    """The pushes' directory: in shared memory (/dev/shm, a tmpfs: nothing touches a disk) when
    it has room for `need_bytes` (after removing the directories of runs that died), else the
    temporary directory."""

    def __init__(self, need_bytes: int) -> None:
        for place in (SHM, Path(tempfile.gettempdir())):  # both: a run may have used either
            sweep(place)
        where: Path | None = None
        if SHM.is_dir() and os.access(SHM, os.W_OK):
            try:
                where = SHM if shutil.disk_usage(SHM).free >= need_bytes else None
            except OSError:
                where = None
        super().__init__(PREFIX, where, swept=True)


def _remove(path: Path, lock: int, owner: int) -> None:
    """The owner's close; a forked child that finalizes its copy only lets go of the fd
    (the lock stays the owner's)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def hold(path: Path) -> int:
    """An open descriptor of `path` (made 0600) holding an exclusive flock on it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep(where: Path) -> list[Path]:
    """Remove this user's directories of PREFIXES in `where` whose owner is gone (their lock
    file unlocked and older than SETTLE_SECONDS); returns them."""
    removed: list[Path] = []
    try:
        entries = [p for p in where.iterdir() if p.name.startswith(PREFIXES)]
    except OSError:
        return removed
    for directory in entries:
        try:
            info = directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            lock = directory / LOCK
            if time.time() - lock.lstat().st_mtime < SETTLE_SECONDS:
                continue
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # no lock file: an older grpod's, or being made
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its run is alive
            os.close(fd)
            continue
        shutil.rmtree(directory, ignore_errors=True)
        os.close(fd)
        removed.append(directory)
    return removed
