"""`DataCursor`: where the engine's data stream stands, as a `Stateful` for checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpod.engine.batch import TransportBatch
from grpod.engine.errors import EngineError


@dataclass
class DataCursor:
    """The next step to roll out and, with epochs > 1, the current generation's batch (its
    samples and old logprobs are reused by every epoch of the generation)."""

    step: int = 0
    rollout_cache: TransportBatch | None = None

    def state_dict(self) -> dict[str, Any]:
        """`{"step": int, "rollout_cache": None | {"tensors": {...}, "metadata": {...}}}`."""
        cache = self.rollout_cache
        saved = (
            None if cache is None else {"tensors": cache.tensors(), "metadata": cache.metadata()}
        )
        return {"step": self.step, "rollout_cache": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            step, cache = int(state["step"]), state.get("rollout_cache")
        except (KeyError, TypeError, ValueError):
            raise EngineError("data cursor: no integer 'step'") from None
        if cache is not None:
            cache = TransportBatch.from_tensors(
                cache["tensors"], cache["metadata"], source="data cursor rollout cache"
            )
        self.step, self.rollout_cache = step, cache
