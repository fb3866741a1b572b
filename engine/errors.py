"""The engine's one exception type: messages name the thing and the reason."""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """A bad config, batch, checkpoint, task or reward, reported in one line."""


class RewardError(EngineError):
    """A reward function that raised, hung past `reward_timeout_seconds` or returned no real
    number (in preflight: no finite one, engine/data/rewardcall.py `NonFinite`): the input's
    fault (exit 2), never a restart. `sample` is the failing completion's index in the
    step's batch; `batch` is set by the rollout that met it (the step's samples with NaN
    rewards, for the incident that keeps them)."""

    def __init__(self, message: str, *, reward: str, sample: int) -> None:
        super().__init__(message)
        self.reward = reward
        self.sample = sample
        self.batch: Any = None  # a TransportBatch (engine/batch.py imports this module)


class SamplerError(RuntimeError):
    """A rollout server that exited, hung or answered garbage: not the input's fault (exit 1,
    a restart resumes), so not an `EngineError`. `batch` is set by the rollout that met it
    (the step's prompts without completions, for the incident that keeps them)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.batch: Any = None  # a TransportBatch (engine/batch.py imports this module)
