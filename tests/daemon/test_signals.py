"""Signal flags: first stop -> finish the step; second -> abandon it; SIGHUP -> reload."""

from __future__ import annotations

import os
import signal

import pytest

from grpod.daemon.signals import AbandonStep, Signals

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out


def test_stop_abandon_and_reload() -> None:
    flags = Signals()
    flags.install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert flags.take_reload() and not flags.take_reload()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flags.stop_signal == signal.SIGTERM and flags.abandon_signal is None
        os.kill(os.getpid(), signal.SIGINT)  # outside compute: a flag only
        assert flags.abandon_signal == signal.SIGINT and flags.stop_count == 2
        flags.abortable = True
        with pytest.raises(AbandonStep):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        assert not flags.abortable
    finally:
        flags.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
