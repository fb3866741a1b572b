"""Running the real `grpod` console script as a subprocess, on the tiny model, tiny batches."""

from __future__ import annotations

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


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """A grpod.toml from {section: {key: value}}; dotted section names for sub-tables."""
    lines = []
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
    """A `grpod run` subprocess whose JSON log lines are collected by a reader thread."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [GRPOD, "run", *args],
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 90.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if predicate(event):
                    return event
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no such event; rc={self.proc.poll()} events={self.events[-3:]}")

    def wait_step(self, step: int, timeout: float = 90.0) -> dict[str, Any]:
        return self.wait_event(lambda e: e["event"] == "step" and e["step"] >= step, timeout)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()
        return rc

    def event(self, name: str) -> dict[str, Any]:
        matches = [e for e in self.events if e["event"] == name]
        assert matches, f"no {name!r} event in {[e['event'] for e in self.events]}"
        return matches[-1]

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]


def run_to_end(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Grpod:
    g = Grpod(args, cwd, env)
    rc = g.wait()
    assert rc == 0, f"grpod run exited {rc}: {g.stderr[-2000:]}"
    return g


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A `grpod` command (not `run`'s service loop) to its end, output captured."""
    return subprocess.run([GRPOD, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


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
