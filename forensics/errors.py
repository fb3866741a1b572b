"""The forensics package's one exception type."""

from __future__ import annotations


class ForensicsError(Exception):
    """Bad forensic input or state: the message names the thing and the reason, in one line."""
