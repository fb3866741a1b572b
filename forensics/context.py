"""Replay under each step's recorded execution context (engine/context.py).

Before a step is re-run, the settings it was recorded under that a process can set (torch's
threads, deterministic algorithms, matmul precision, TF32, cuBLAS workspace) are set on the
engine, which applies them for its passes: a step recorded at 2 threads replays at 2
whatever the shell's OMP_NUM_THREADS says. What a running process cannot change (the CPU
capability torch dispatches to, the torch or transformers build, the device) is compared:
each field that differs is named, and the step's numbers are then compared within
REPLAY_RTOL (forensics/compare.py), never called bit-exact or not without saying why.
"""

from __future__ import annotations

import json
from typing import Any

from grpod.engine import Engine
from grpod.engine.context import (
    RESTORABLE,
    ContextDifference,
    ExecutionContext,
    differences,
)

# torch's spelling for ATEN_CPU_CAPABILITY: a lower capability can be chosen at start
_CAPABILITY_ENV = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512"}  # x86, lowest first


def recorded_context(context_json: str | None) -> ExecutionContext | None:
    """A step row's `context_json` (None: recorded before schema 0006, or by a TRL run)."""
    return None if context_json is None else ExecutionContext.from_dict(json.loads(context_json))


class ContextRestore:
    """Sets each replayed step's recorded context on `engine` and keeps what differed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.shell = engine.context  # what this process runs under unless told otherwise
        self.restored: dict[str, dict[str, Any]] = {}  # field -> {recorded, shell}
        self.differs: dict[str, ContextDifference] = {}  # field -> first difference seen
        self.unrecorded = 0  # steps recorded without a context

    def before(self, recorded: ExecutionContext | None) -> str:
        """Run the next step under `recorded`; returns why its numbers may differ from the
        record ('' when every field that decides them is the record's)."""
        if recorded is None:
            self.unrecorded += 1
            self.engine.context = self.shell
            return ""
        self.engine.context = self.shell.restorable_from(recorded)
        for name in RESTORABLE:
            was, now = getattr(recorded, name), getattr(self.shell, name)
            if was != now:
                self.restored.setdefault(name, {"recorded": was, "shell": now})
        found = differences(recorded, self.engine.context)
        for difference in found:
            self.differs.setdefault(difference.field, difference)
        decisive = [d for d in found if d.decides]
        if not decisive:
            return ""
        return "context differs: " + ", ".join(map(str, decisive))

    @property
    def decisive(self) -> list[ContextDifference]:
        """The differing fields that can change the trainer's floats."""
        return [d for d in self.differs.values() if d.decides]

    def summary(self) -> dict[str, Any]:
        """For `ReplayResult.context`: whether every step had a recorded context, what was
        restored, what differs, and the lines `grpod replay` prints about it."""
        return {
            "notes": self.notes(),
            "recorded": self.unrecorded == 0,
            "restored": self.restored,
            "differs": [
                {
                    "field": d.field,
                    "recorded": d.recorded,
                    "replayed": d.replayed,
                    "decides": d.decides,
                }
                for d in self.differs.values()
            ],
        }

    def notes(self) -> list[str]:
        """One line each: the fields restored, the fields that differ (and how to choose a
        recorded CPU capability), steps without a recorded context."""
        notes = []
        if self.restored:
            set_ = ", ".join(
                f"{name} {v['recorded']!r} (the shell's {v['shell']!r})"
                for name, v in self.restored.items()
            )
            notes.append(f"context restored: {set_}")
        for difference in self.differs.values():
            why = "cannot be restored in a running process"
            if not difference.decides:
                why = "does not change the trainer's numbers"
            hint = _capability_hint(difference)
            notes.append(f"context differs: {difference} ({why}{hint})")
        if self.unrecorded:
            notes.append(
                f"{self.unrecorded} step(s) recorded without an execution context (a store "
                "before schema 0006): run under the shell's"
            )
        return notes


def _capability_hint(difference: ContextDifference) -> str:
    """How to dispatch to the recorded CPU capability, where this CPU has it too."""
    order = list(_CAPABILITY_ENV)
    if difference.field != "cpu_capability":
        return ""
    recorded, now = str(difference.recorded), str(difference.replayed)
    if recorded in order and now in order and order.index(recorded) < order.index(now):
        return f": start the replay with ATEN_CPU_CAPABILITY={_CAPABILITY_ENV[recorded]}"
    return ""
