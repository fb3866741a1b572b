"""Held-out evaluation between steps (engine/grpo/eval.py): stored, published and logged; the
policy, the data cursor and the next batch are untouched."""

from __future__ import annotations

import math
from typing import Any

from grpod.daemon.metrics import Metrics
from grpod.engine.errors import RewardError
from grpod.engine.grpo.eval import Evaluator
from grpod.guards import GuardPolicy


class Evaluations:
    """`run(step)` every `eval_every` steps; an eval reward's failure is stored and WARNed,
    and stops the run (exit 2) when `on_error` is "stop"."""

    def __init__(
        self,
        evaluator: Evaluator,
        recorder: Any,
        metrics: Metrics | None,
        log: Any,
        *,
        temperature: float,
        on_error: str,
        policy: GuardPolicy | None = None,
    ) -> None:
        self.evaluator, self.recorder, self.metrics, self.log = evaluator, recorder, metrics, log
        self.temperature, self.on_error = temperature, on_error
        self.policy = policy  # reward_hacking reads the eval as its second opinion

    def run(self, step: int) -> str | None:
        """Evaluate the policy as it stands before `step`; the input failure that stops the
        run (`eval_on_error = "stop"`), else None."""
        try:
            result = self.evaluator.run()
        except RewardError as exc:
            return self._failed(step, exc)
        self.recorder.note_eval(result.to_dict())
        if self.policy is not None:
            self.policy.observe_eval(result.step, result.rewards)
        if self.metrics is not None:
            self.metrics.observe_eval(result.step, result.rewards)
            self.metrics.phase_seconds.labels("eval").observe(result.seconds)
        self.log.info("eval", **result.to_dict())
        return None

    def _failed(self, step: int, exc: RewardError) -> str | None:
        """The eval stored as failed (total NaN, the error beside it) and WARNed."""
        error = f"eval at step {step}: {exc}"
        self.recorder.note_eval(
            {
                "step": step,
                "samples": 0,
                "temperature": self.temperature,
                "rewards": {"total": math.nan, "error": error},
                "completion_length_mean": 0.0,  # NOT NULL (SQLite stores NaN as NULL)
                "seconds": 0.0,
            }
        )
        if self.metrics is not None:
            self.metrics.observe_eval(step, {"total": math.nan})
        stop = self.on_error == "stop"
        self.log.warning("eval failed", error=error, action="stop" if stop else "continue")
        return error if stop else None
