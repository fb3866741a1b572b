"""sd_notify over a real datagram socket bound by the test."""

from __future__ import annotations

import socket
from pathlib import Path

from grpod.daemon.notify import Notifier


def _bound(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(1.0)
    return sock


def test_messages_reach_the_socket(tmp_path: Path) -> None:
    sock = _bound(tmp_path / "n.sock")
    now = [0.0]
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")}, clock=lambda: now[0])
    notifier.ready("step 0")
    assert sock.recv(256) == b"READY=1\nSTATUS=step 0"
    notifier.watchdog()
    notifier.watchdog()  # within the interval: not sent
    now[0] = 1.5
    notifier.watchdog()
    assert [sock.recv(256), sock.recv(256)] == [b"WATCHDOG=1", b"WATCHDOG=1"]
    notifier.extend_timeout(2.5)
    assert sock.recv(256) == b"EXTEND_TIMEOUT_USEC=2500000"
    assert sock.recv(256) == b"WATCHDOG=1"  # checkpoints also ping the watchdog
    notifier.status("two\nlines")
    assert sock.recv(256) == b"STATUS=two lines"
    notifier.stopping("stopped: done")
    assert sock.recv(256) == b"STOPPING=1\nSTATUS=stopped: done"
    notifier.close()
    sock.close()


def test_abstract_socket_and_watchdog_period() -> None:
    name = f"grpod-test-{id(object())}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(1.0)
    notifier = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "600000"})
    assert notifier.watchdog_usec == 600_000 and notifier._watchdog_interval == 0.3
    notifier.watchdog()
    assert sock.recv(64) == b"WATCHDOG=1"
    sock.close()


def test_without_socket_is_a_no_op_and_foreign_watchdog_ignored() -> None:
    notifier = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert not notifier.enabled and notifier.watchdog_usec == 0
    notifier.ready("x")
    notifier.watchdog()


def test_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    notifier.status("nobody listens")
