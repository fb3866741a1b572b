"""Every package's one exception type, gathered for the CLI boundary."""

from __future__ import annotations

from grpod.base.oneline import one_line
from grpod.engine.errors import EngineError


class ConfigError(Exception):
    """A bad grpod.toml: the message names the key path and the reason."""


def _collect() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EngineError, ConfigError]
    try:
        from grpod.guards.errors import GuardsError

        errors.append(GuardsError)
    except ImportError:
        pass
    try:
        from grpod.forensics.errors import ForensicsError

        errors.append(ForensicsError)
    except ImportError:
        pass
    return tuple(errors)


BAD_INPUT_ERRORS = _collect()


def failure_reason(exc: BaseException) -> str:
    """One line for a failure that is not the input's: an OSError's reason and file
    (`No space left on device (/var/lib/grpod/run/status.json)`), else the error quoted whole
    (safetensors' own error type for a failed write)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return one_line(exc)
