"""`say`: a one-line error on stderr in one write, which another process sharing the stderr
pipe cannot split (torchrun's ranks and their agent: tests/daemon/test_torchrun.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpod.base.oneline import say


class Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.flushed = 0

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushed += 1


def test_the_line_and_its_newline_are_one_write_then_flushed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    say("grpod run: error: cannot start: SamplerError: x")
    assert stream.calls == ["grpod run: error: cannot start: SamplerError: x\n"]
    assert stream.flushed == 1


def test_processes_saying_lines_at_once_never_split_one() -> None:
    """Eight processes, 200 lines each, one pipe: every line arrives whole."""
    code = (
        "import sys; from grpod.base.oneline import say\n"
        "for i in range(200): say(f'grpod run: error: rank {sys.argv[1]} line {i} ' + 'x' * 200)"
    )
    read, write = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(rank)], stderr=write) for rank in range(8)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait() for p in procs] == [0] * 8
    assert len(lines) == 8 * 200
    assert all(
        line.startswith("grpod run: error: rank ") and line.endswith("x" * 200) for line in lines
    )
