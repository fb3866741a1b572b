"""The GRPO engine. Knows nothing of guards, metrics or stores.

Public names are imported on first use (grpod/lazy.py): `engine.config` and
`engine.errors` load without torch.
"""

from grpod.lazy import lazy_exports

__all__ = ["ChunkTrace", "Engine", "EngineConfig", "EngineError", "StepReport", "TransportBatch"]
__getattr__ = lazy_exports(
    __name__,
    {
        "ChunkTrace": "grpod.engine.report",
        "Engine": "grpod.engine.trainer",
        "EngineConfig": "grpod.engine.config",
        "EngineError": "grpod.engine.errors",
        "StepReport": "grpod.engine.report",
        "TransportBatch": "grpod.engine.batch",
    },
)
