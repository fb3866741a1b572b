"""`Action`, `Finding`, `Verdict` and `Outcome`: what is said about a step and what became of it.

The vocabulary of a decided step, defined once: the guards produce findings and verdicts,
replay and the recorder read them, the daemon publishes them. Engine types (no torch), so
forensics can use them without importing guards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, Literal

from grpod.base.jsonsafe import to_json

ActionName = Literal["PASS", "WARN", "FLUSH", "HALT"]


class Action(IntEnum):
    """Ordered so the highest action wins: PASS < WARN < FLUSH < HALT."""

    PASS = 0  # apply the step (a finding at PASS is information, e.g. a reorder)
    WARN = 1  # apply the step, raise the finding
    FLUSH = 2  # discard the step's gradients; weights, optimizer and schedule untouched
    HALT = 3  # discard the step and stop the run


ACTION_NAMES: tuple[str, ...] = tuple(a.name for a in Action)  # PASS..HALT, in order


class Outcome(str, Enum):
    """What became of a step's update (a str: stored, logged and labelled by its value)."""

    __str__ = str.__str__  # "applied", not "Outcome.APPLIED" (enum.StrEnum is Python 3.11+)

    APPLIED = "applied"  # optimizer step taken
    FLUSHED = "flushed"  # computed, gradients discarded
    SKIPPED = "skipped"  # flushed without computing (a before-hook asked)


@dataclass
class Finding:
    """One guard's observation about one step, with the numbers behind it.

    `kind` tells a guard's conditions apart ("" when it has one): the flight recorder keeps
    one incident per (guard, kind) episode of consecutive steps. `evidence["severity"]`, when
    a guard gives one, orders an episode's steps (its worst step's batch is pinned).
    """

    guard: str
    action: Action
    message: str
    evidence: dict[str, float] = field(default_factory=dict)
    kind: str = ""

    def to_dict(self) -> dict[str, Any]:
        """`{"guard", "action", "message", "evidence"}`, and `"kind"` when it has one."""
        data = {
            "guard": self.guard,
            "action": self.action.name,
            "message": self.message,
            "evidence": {k: to_json(float(v)) for k, v in self.evidence.items()},
        }
        if self.kind:
            data["kind"] = self.kind
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        evidence = {k: float(v) for k, v in data.get("evidence", {}).items()}
        kind = str(data.get("kind", ""))
        return cls(data["guard"], Action[data["action"]], data["message"], evidence, kind)


@dataclass(frozen=True)
class Verdict:
    """The highest action over every finding of a step, and the findings themselves; built
    once (`Verdict.of` the step's findings), never edited afterwards."""

    action: Action
    findings: list[Finding] = field(default_factory=list)

    @classmethod
    def of(cls, findings: list[Finding]) -> Verdict:
        action = max((f.action for f in findings), default=Action.PASS)
        return cls(Action(action), list(findings))

    def by(self, guard: str) -> list[Finding]:
        """The findings of one guard."""
        return [f for f in self.findings if f.guard == guard]

    def to_dict(self) -> dict[str, Any]:
        """`{"action": "FLUSH", "findings": [{"guard", "action", "message", "evidence"}]}`."""
        return {"action": self.action.name, "findings": [f.to_dict() for f in self.findings]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(Action[data["action"]], [Finding.from_dict(f) for f in data["findings"]])
