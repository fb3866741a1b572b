"""One live `grpod run` per run directory: an exclusive `fcntl.flock` on `<run_dir>/lock`.

The kernel releases the lock when its process dies (SIGKILL included), so a lock is never
stale; the file keeps the holder's pid for the message the next contender prints. Readers
(`status`, `replay`, `incidents`, `fsck`, `plot`) never take it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from grpod.daemon.errors import ConfigError

LOCK_NAME = "lock"


class RunDirLock:
    """The held lock of one run directory; `release()` (or process exit) lets it go."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, *, shown_as: str | None = None) -> RunDirLock:
        """Take the lock of `run_dir` or raise ConfigError naming the pid that holds it.

        `shown_as` is the directory named in the message (a run dir being built in a temp)."""
        path = Path(run_dir) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"run dir {shown_as or run_dir}: cannot open {path.name}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"run dir {shown_as or run_dir}: in use by grpod run pid {holder} "
                "(one live run per directory; status, replay, incidents, fsck and plot read it)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1
