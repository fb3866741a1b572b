"""Every package's one exception type, gathered for the CLI boundary."""

from __future__ import annotations

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
