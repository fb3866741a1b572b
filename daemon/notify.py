"""systemd notify protocol over `NOTIFY_SOCKET`, with the standard library only.

READY=1 once restored, WATCHDOG=1 from the training loop itself (so a hung step stops the
pings and systemd's watchdog fires), STATUS= with the step and the last verdict,
EXTEND_TIMEOUT_USEC while checkpointing, STOPPING=1 on the way out. Without `NOTIFY_SOCKET`
every call is a no-op, so the same code runs under systemd, in a shell and in tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping


class Notifier:
    """One datagram per message to the socket systemd (or a test) bound at `NOTIFY_SOCKET`."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path  # '@': abstract
        self._socket: socket.socket | None = None
        if self._address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_usec = _watchdog_usec(env)
        # ping at half the watchdog period, and at most once a second without a watchdog
        self._watchdog_interval = min(1.0, self.watchdog_usec / 2e6) if self.watchdog_usec else 1.0
        self._clock = clock
        self._last_watchdog: float | None = None
        # a rank under grpod's launcher notifies the agent: each message names its local rank
        launched = bool(env.get("GRPOD_LAUNCHER"))
        self._tag = {"GRPOD_RANK": env.get("LOCAL_RANK", "0")} if launched else {}

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, **fields: object) -> None:
        """Send `KEY=value` lines in one datagram; errors are swallowed (systemd may be gone)."""
        if self._socket is None:
            return
        text = "\n".join(f"{key}={value}" for key, value in {**fields, **self._tag}.items())
        with contextlib.suppress(OSError):  # a vanished notify socket must never stop training
            self._socket.sendto(text.encode(), self._address)

    def register(self) -> None:
        """Under grpod's launcher only: this rank's pid, where the agent forwards signals (a
        MAINPID= to systemd itself would make this process the unit's main one)."""
        if self._tag:
            self.send(MAINPID=os.getpid())

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, text: str) -> None:
        self.send(STATUS=text.replace("\n", " "))

    def watchdog(self) -> None:
        """WATCHDOG=1, rate-limited to half the watchdog period; call it from the loop."""
        now = self._clock()
        if self._last_watchdog is not None and now - self._last_watchdog < self._watchdog_interval:
            return
        self._last_watchdog = now
        self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> None:
        """Ask for `seconds` more of start/stop timeout (checkpoints, model loading)."""
        self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))
        self._last_watchdog = None
        self.watchdog()

    def stopping(self, status: str) -> None:
        self.send(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_usec(env: Mapping[str, str]) -> int:
    """systemd's watchdog period for this process, or 0 when it is off or meant for another."""
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return 0
    try:
        return max(0, int(env.get("WATCHDOG_USEC", "0")))
    except ValueError:
        return 0
