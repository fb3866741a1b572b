"""The guarded TRL run's sink: what it refuses before it makes the run directory."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from grpod.daemon.errors import ConfigError
from grpod.forensics.config import ForensicsConfig
from grpod.guards.config import GuardsConfig
from grpod.integrations.trl_sink import RunSink


def sink_at(run_dir: Path, port: int) -> RunSink:
    return RunSink(
        run_dir,
        GuardsConfig(),
        ForensicsConfig(),
        log_samples=0,
        metrics_host="127.0.0.1",
        metrics_port=port,
    )


def test_a_metrics_port_that_is_taken_is_one_line_before_the_run_dir(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sink = sink_at(tmp_path / "run", port)
        with pytest.raises(ConfigError) as raised:
            sink.start(None, {}, {}, "cpu")
    said = str(raised.value)
    assert said.startswith(f"grpod.metrics_port: cannot bind 127.0.0.1:{port}: "), said
    assert "\n" not in said
    assert not (tmp_path / "run").exists()  # nothing made: the next attempt starts clean
    assert sink.server is None


def test_a_free_metrics_port_is_served_once_the_run_is_open(tmp_path: Path) -> None:
    sink = sink_at(tmp_path / "run", 0)  # any free port
    sink.start(None, {}, {}, "cpu")
    try:
        assert sink.metrics_url is not None and sink.metrics_url.endswith("/metrics")
        assert (tmp_path / "run" / "run.json").is_file()
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) & 0o007 == 0
    finally:
        sink.close("stopped", halted=False)
