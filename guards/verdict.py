"""The guards' vocabulary: `Action`, `Finding`, `Verdict` live with the engine types
(grpod/engine/verdict.py), which replay and the recorder read without importing guards."""

from grpod.engine.verdict import ACTION_NAMES, Action, ActionName, Finding, Verdict

__all__ = ["ACTION_NAMES", "Action", "ActionName", "Finding", "Verdict"]
