"""Running the real `grpod` console script as a subprocess, on the tiny model, tiny batches."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpod.guards.workloads import W2_GEOMETRY

GRPOD = str(Path(sys.executable).with_name("grpod"))

TINY_ENGINE = {
    "task": "copy",
    "prompts_per_step": 4,
    "group_size": 4,
    "micro_batch_rows": 4,
    "seq_len": 16,
    "max_new_tokens": 2,
    "threads": 1,
}
# W2 (long prompts, 256-token rows in 4 sequence chunks), one row per micro: the torchrun
# tests' and benches' engine (bench/common.py `W2_ENGINE`)
# W1c's copy task through a vLLM server (truncated importance sampling on): the server
# campaigns' engine (tests/vllm/test_server*.py, bench/server_torchrun.py), which add their
# new-token budget and staleness
SERVER_ENGINE = {
    "rollout_backend": "vllm-server",
    "task": "copy",
    "prompts_per_step": 4,
    "group_size": 4,
    "seq_len": 64,
    "threads": 1,
    "tis_cap": 2.0,
}
W2_ENGINE = {
    **W2_GEOMETRY,
    "prompts_per_step": 4,
    "group_size": 4,
    "micro_batch_rows": 1,
    "threads": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. engine.faults
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# The incident attribution (forensics/incident_attribution.py) is on by default: a child
# process per incident, which the daemon waits for at exit. The suite's daemons turn it off
# unless a test names the section (tests/daemon/test_incident_attribution.py): on 2 cores
# every drill's child competed with the other worker's tests.
ATTRIBUTION_OFF = {"forensics.attribution": {"enabled": False}}


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """A grpod.toml from {section: {key: value}}; dotted section names for sub-tables."""
    lines = []
    sections = {**ATTRIBUTION_OFF, **sections}
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in keys.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def tiny_config(path: Path, port: int, engine: dict[str, Any] | None = None, **daemon: Any) -> Path:
    """The tiny test config: metrics on `port`, JSON logs, state digest logged at exit."""
    return write_config(
        path,
        {
            "engine": {**TINY_ENGINE, **(engine or {})},
            "daemon": {
                "metrics_port": port,
                "log_format": "json",
                "progress": "off",
                "checkpoint_every": 2,
                "state_digest_on_exit": True,
                **daemon,
            },
        },
    )


class Grpod:
    """A `grpod run` subprocess whose JSON log lines are collected by a reader thread.

    `on_event(event)` runs on that thread for every line as it is read; with `pipe_bytes`
    the log pipe holds that little (a page at least), so the daemon blocks on its next line
    until the reader has taken the last ones: what `on_event` samples is never more than a
    pipe's worth of log behind the daemon, however fast or slow either of them runs.
    """

    def __init__(
        self,
        args: list[str],
        cwd: Path,
        env: dict[str, str] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        pipe_bytes: int | None = None,
    ) -> None:
        read, write = os.pipe()
        if pipe_bytes is not None:
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, pipe_bytes)  # before the daemon writes
        try:
            self.proc = subprocess.Popen(
                [GRPOD, "run", *args],
                cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            os.close(write)
        self._stdout = open(read, encoding="utf-8")  # noqa: SIM115 (the reader closes it)
        self.events: list[dict[str, Any]] = []
        self.stderr = ""
        self._on_event = on_event
        self._on_event_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self._stdout:
            for line in self._stdout:
                event = json.loads(line)
                self.events.append(event)
                if self._on_event is not None and self._on_event_error is None:
                    try:
                        self._on_event(event)
                    except BaseException as exc:  # raised again by wait(); keep draining
                        self._on_event_error = exc

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 90.0
    ) -> dict[str, Any]:
        """The first event `predicate` accepts; `timeout` only bounds a wait that fails."""
        deadline = time.monotonic() + timeout
        while True:
            # taken before the scan: the reader may add the event and end between the two
            ended = self.proc.poll() is not None and not self._reader.is_alive()
            for event in list(self.events):
                if predicate(event):
                    return event
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        raise AssertionError(f"no such event; rc={self.proc.poll()} events={self.events[-3:]}")

    def wait_step(self, step: int, timeout: float = 90.0) -> dict[str, Any]:
        return self.wait_event(lambda e: e["event"] == "step" and e["step"] >= step, timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()
        if self._on_event_error is not None:
            raise self._on_event_error
        return rc

    def event(self, name: str) -> dict[str, Any]:
        matches = [e for e in self.events if e["event"] == name]
        assert matches, f"no {name!r} event in {[e['event'] for e in self.events]}"
        return matches[-1]

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]


class NotifySocket:
    """A datagram socket bound where NOTIFY_SOCKET points, collecting every message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        """Stop the reader, then take what is still queued (the sender has exited)."""
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.setblocking(False)
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                break
        self.sock.close()

    def fields(self, key: str) -> list[str]:
        return [
            line.split("=", 1)[1]
            for message in self.messages
            for line in message.splitlines()
            if line.startswith(f"{key}=")
        ]


def wait_until(
    done: Callable[[], bool],
    what: str,
    alive: Callable[[], bool] = lambda: True,
    timeout: float = 120.0,
    every: float = 0.01,
) -> None:
    """Poll `done` every `every` seconds until it holds; fail if `alive` turns false first.
    `timeout` only bounds a wait that fails: the verdict is `done`, never how long it took."""
    deadline = time.monotonic() + timeout
    while True:
        ended = not alive()  # taken before `done`: it may hold just as the process ends
        if done():
            return
        assert not ended, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(every)


def run_to_end(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Grpod:
    g = Grpod(args, cwd, env)
    rc = g.wait()
    assert rc == 0, f"grpod run exited {rc}: {g.stderr[-2000:]}"
    return g


def cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A `grpod` command (not `run`'s service loop) to its end, output captured; `env` is
    added to this process's environment."""
    return subprocess.run(
        [GRPOD, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as written)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values
