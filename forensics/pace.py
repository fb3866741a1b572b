"""The incident attribution's pace: its child process keeps its CPU time to a share of the
wall clock (`[forensics.attribution] run_fraction`), so it takes at most that share of a core
(or of a GPU, which has no idle priority) from the trainer. On the CPU SCHED_IDLE already
does that: a W1 step beside an unpaced attribution runs at 0.992 of its speed without one
(bench/README.md), so the CPU's default is unpaced.

The child paces itself; nothing is signalled. `Pace.pace()` runs before every module's forward
(a global forward pre-hook, `install`) and between the child's phases: when the process's CPU
seconds so far exceed `run_fraction` of its wall seconds so far, it sleeps until they do not.
The daemon frees it (full speed) by closing the write end of a pipe whose read end the child
holds (`GRPOD_ATTRIBUTION_FREE_FD`): at shutdown, when the trainer no longer steps and the
attribution in progress has `shutdown_wait_seconds` to finish. A daemon that dies closes it too
(the child's orphan check then ends it).
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import Any

FREE_FD_ENV = "GRPOD_ATTRIBUTION_FREE_FD"
CHECK_SECONDS = 0.02  # the hook's cheap path: at most one CPU-time reading per 20 ms


class Pace:
    """Keeps this process's CPU seconds at most `fraction` of its wall seconds since
    `started` (a `time.monotonic()` taken at the process's start); `free_fd`: the read end of
    the daemon's pipe, readable (EOF) once the daemon frees the pace (-1: none)."""

    def __init__(self, fraction: float, started: float, free_fd: int = -1) -> None:
        self.fraction = fraction
        self.free = fraction >= 1
        self.slept_seconds = 0.0
        self._started, self._free_fd = started, free_fd
        self._cpu_started = 0.0  # process_time() counts from the process's start
        self._next_check = 0.0

    @classmethod
    def from_env(cls, fraction: float, started: float) -> Pace:
        """The child's pace, with the daemon's free pipe when the environment names one."""
        with contextlib.suppress(KeyError, ValueError):
            return cls(fraction, started, int(os.environ[FREE_FD_ENV]))
        return cls(fraction, started)

    def pace(self, *_: Any) -> None:
        """Sleep as long as this process is ahead of its share (a forward pre-hook's
        signature: the module and its inputs are ignored; returns None, changing nothing)."""
        if self.free:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        used = time.process_time() - self._cpu_started
        wait = self._started + used / self.fraction - now
        if wait > 0:
            self._sleep(wait)
        self._next_check = time.monotonic() + CHECK_SECONDS

    def install(self) -> None:
        """Pace before every module's forward (torch's global forward pre-hook)."""
        import torch

        torch.nn.modules.module.register_module_forward_pre_hook(self.pace)

    def _sleep(self, seconds: float) -> None:
        slept = time.monotonic()
        if self._free_fd < 0:
            time.sleep(seconds)
        else:
            readable, _, _ = select.select([self._free_fd], [], [], seconds)
            self.free = bool(readable)
        self.slept_seconds += time.monotonic() - slept


class FreePipe:
    """The daemon's side: `read_fd` goes to the child (`pass_fds`, named in its environment);
    `free()` closes the write end, letting the child run at full speed from then on."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_inheritable(self.read_fd, True)

    def env(self) -> dict[str, str]:
        return {FREE_FD_ENV: str(self.read_fd)}

    def started(self) -> None:
        """The child holds its copy of the read end: close the daemon's."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def free(self) -> None:
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    def close(self) -> None:
        self.started()
        self.free()
