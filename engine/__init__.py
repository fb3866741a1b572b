"""The GRPO engine. Knows nothing of guards, metrics or stores.

Its top-level modules are the vocabulary every part shares (`batch`, `report`, `verdict`,
`config`, `errors`, `context`, `phases`, `kvcache`, `weight_sync`, `faults`); the parts are
sub-packages, each importing only those below it: `data/` -> `model/` -> `rollout/` |
`train/` | `state/` (never each other) -> `grpo/` (the `Engine`). docs/ARCHITECTURE.md
draws the layers; `make lint` checks them.

Public names are imported on first use (grpod/base/lazy.py): `engine.config` and
`engine.errors` load without torch. A decided step is a `StepResult` from `decide_step`
(engine/grpo/step.py); its vocabulary (`Action`, `Verdict`, `Outcome`) is engine/verdict.py.
"""

from grpod.base.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "Action": "grpod.engine.verdict",
        "ChunkTrace": "grpod.engine.report",
        "Engine": "grpod.engine.grpo.trainer",
        "EngineConfig": "grpod.engine.config",
        "EngineError": "grpod.engine.errors",
        "Finding": "grpod.engine.verdict",
        "Outcome": "grpod.engine.verdict",
        "StepReport": "grpod.engine.report",
        "StepResult": "grpod.engine.grpo.step",
        "TransportBatch": "grpod.engine.batch",
        "Verdict": "grpod.engine.verdict",
        "decide_step": "grpod.engine.grpo.step",
    },
)
