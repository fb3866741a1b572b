"""structlog JSON lines with run_id/step/rank from contextvars; console on a TTY."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator

from grpod.daemon import logs


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_carry_context_and_finite_json() -> None:
    out = io.StringIO()
    log = logs.make_logger("auto", "info", stream=out)
    logs.bind_run("run-1", 0)
    try:
        with logs.step_context(7):
            log.info("step", loss=float("nan"), grad_norm=float("inf"), nested={"x": -float("inf")})
        log.debug("hidden")
        log.warning("after")
    finally:
        logs.clear()
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "step" and first["run_id"] == "run-1" and first["rank"] == 0
    assert first["step"] == 7 and first["level"] == "info" and first["ts"].endswith("Z")
    assert first["loss"] == "nan" and first["grad_norm"] == "inf" and first["nested"]["x"] == "-inf"
    assert "step" not in second and second["level"] == "warning"


def test_console_on_a_tty_and_dropped_events() -> None:
    out = _Tty()
    calls = []

    @contextlib.contextmanager
    def around() -> Iterator[None]:
        calls.append("enter")
        yield
        calls.append("exit")

    log = logs.make_logger("auto", "info", stream=out, around_write=around, drop_events={"step"})
    log.info("step", loss=1.0)
    log.info("checkpoint", path="p")
    text = out.getvalue()
    assert "checkpoint" in text and "path" in text and not text.lstrip().startswith("{")
    assert "loss" not in text and calls == ["enter", "exit"]
