"""structlog logging: JSON lines on stdout (journald-friendly), console rendering on a TTY.

The logger is an object built here and passed around; `run_id`, `step` and `rank` are bound
through `structlog.contextvars` so every event of a step carries them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from grpod.base.jsonsafe import dumps

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def make_logger(
    fmt: str = "auto",
    level: str = "info",
    stream: TextIO | None = None,
    around_write: Callable[[], AbstractContextManager[Any]] | None = None,
    drop_events: frozenset[str] = frozenset(),
) -> structlog.typing.FilteringBoundLogger:
    """A logger writing one event per line to `stream` (stdout by default).

    fmt: "json", "console", or "auto" (console when `stream` is a TTY). `around_write()` is
    entered around each line (the daemon's: the held step lines go first and the progress
    bar clears itself, and no burst redraws it before the line is out); `drop_events` names
    events left out of this stream when it is a terminal (the progress bar shows `step`
    instead); piped to a file or journald every event stays.
    """
    out = sys.stdout if stream is None else stream
    console = fmt == "console" or (fmt == "auto" and _isatty(out))
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        # a line sent after its event (a held step's, daemon/sink.py) brings its own `ts`
        structlog.processors.MaybeTimeStamper(fmt="iso", utc=True, key="ts"),
    ]
    if drop_events and _isatty(out):
        processors.append(_Drop(drop_events))
    if console:
        processors.append(structlog.dev.ConsoleRenderer(colors=_isatty(out)))
    else:
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=dumps, sort_keys=False),
        ]
    return structlog.wrap_logger(
        _Printer(out, around_write),
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        # bound once, not on every call: the lazy proxy otherwise rebuilds it per event
        cache_logger_on_first_use=True,
    )


# vLLM's own logger, and what importing it warns of on stderr: Python warnings (its
# deprecated torch calls) and torch's triton probe
VLLM_LOGGERS = ("vllm", "py.warnings", "torch._library")


def forward_library_logs(
    log: structlog.typing.FilteringBoundLogger, names: tuple[str, ...], level: str = "info"
) -> None:
    """Route the standard-library loggers `names` (a library's, e.g. vLLM's) into `log`'s
    stream: one `library` event per record (its logger, level and message), so stdout stays
    one JSON object per line and stderr grpod's. The library's INFO records are grpod's debug
    events. `py.warnings` among them: Python warnings become its records."""
    for name in names:
        library = logging.getLogger(name)
        library.handlers[:] = [_Forward(log)]
        library.propagate = False
        library.setLevel(logging.INFO if level == "debug" else logging.WARNING)
    if "py.warnings" in names:
        logging.captureWarnings(True)


class _Forward(logging.Handler):
    def __init__(self, log: structlog.typing.FilteringBoundLogger) -> None:
        super().__init__()
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            method = self._log.error
        elif record.levelno >= logging.WARNING:
            method = self._log.warning
        else:
            method = self._log.debug
        try:
            message = " ".join(record.getMessage().split())  # one line
        except Exception:  # a library's bad format string must not end the run
            message = str(record.msg)
        method("library", logger=record.name, level_name=record.levelname, message=message)


def iso_utc(seconds: float) -> str:
    """`seconds` (time.time()) as the `ts` field writes the present: ISO 8601, UTC, "Z"."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def bind_run(run_id: str, rank: int) -> None:
    """Bind the run's identity for every event that follows (contextvars)."""
    structlog.contextvars.bind_contextvars(run_id=run_id, rank=rank)


def step_context(step: int) -> contextlib.AbstractContextManager[None]:
    """Bind `step` for the events of one step (and only those)."""
    return structlog.contextvars.bound_contextvars(step=step)


def clear() -> None:
    structlog.contextvars.clear_contextvars()


class _Printer:
    """structlog's PrintLogger with a context around each line, flushed per line (journald)."""

    def __init__(
        self, stream: TextIO, around_write: Callable[[], AbstractContextManager[Any]] | None
    ) -> None:
        self._stream = stream
        self._around = around_write

    def msg(self, message: str) -> None:
        with nullcontext() if self._around is None else self._around():
            try:
                self._stream.write(message + "\n")
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # stdout gone (closed pipe): logging must not stop training

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


class _Drop:
    def __init__(self, events: frozenset[str]) -> None:
        self._events = events

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        if event.get("event") in self._events:
            raise structlog.DropEvent
        return event


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
