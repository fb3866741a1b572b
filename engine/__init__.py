"""The GRPO engine. Knows nothing of guards, metrics or stores.

Public names are imported on first use (engine/lazy.py): `engine.config` and
`engine.errors` load without torch.
"""

from engine.lazy import lazy_exports

__all__ = ["ChunkTrace", "Engine", "EngineConfig", "EngineError", "StepReport", "TransportBatch"]
__getattr__ = lazy_exports(
    __name__,
    {
        "ChunkTrace": "engine.report",
        "Engine": "engine.trainer",
        "EngineConfig": "engine.config",
        "EngineError": "engine.errors",
        "StepReport": "engine.report",
        "TransportBatch": "engine.batch",
    },
)
