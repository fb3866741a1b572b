"""One line for an exception, quoted whole: its message's lines joined, so that a third-party
error (PEFT's module repr, a Jinja template error, torch's checkpoint exception) is not cut to
a first line that says nothing (`Target module Qwen2MLP(`). Where the first line is what
says it (a loader's or a database driver's message), `first_line`. `say` writes such a line
where processes share one stderr (torchrun's ranks and their agent)."""

from __future__ import annotations

import sys


def one_line(exc: BaseException, *, with_type: bool = True) -> str:
    """`Type: message` (or the message alone) with every line stripped and joined by spaces."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    if not with_type:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def say(line: str) -> None:
    """`line` and its newline on stderr in one write, flushed: the ranks of a job and their
    agent share one stderr, and `print` writes the newline apart, so another process's line
    landed between the two (tests/daemon/test_torchrun.py, a node server that dies while
    starting: "...no device to start ongrpod run: error: ..."). One write of a line under
    PIPE_BUF (4096 bytes) to a pipe is never split."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
