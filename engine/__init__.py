"""The GRPO engine. Knows nothing of guards, metrics or stores."""

from engine.batch import TransportBatch
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.report import ChunkTrace, StepReport
from engine.trainer import Engine

__all__ = ["ChunkTrace", "Engine", "EngineConfig", "EngineError", "StepReport", "TransportBatch"]
