"""The guards package's one exception type."""

from __future__ import annotations


class GuardsError(Exception):
    """Bad guard input (config, saved policy state, drill name): the message names it and why."""
