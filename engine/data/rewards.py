"""Several reward functions with weights, as TRL's `reward_funcs` / `reward_weights`.

`[engine] rewards = ["mod:f", "mod:g"]` and `reward_weights = [1.0, 0.5]`: a completion's
reward is the weighted sum; each function's own values travel in the batch's
`function_rewards` (for the report's per-function mean and std). Without `rewards` the task's
own reward (or `reward = "mod:f"`) is the only one and nothing is added to the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpod.engine.data.rewardcall import NonFinite, reward_alarm
from grpod.engine.data.tasks import Prompt, RewardFn, Task, load_reward


@dataclass(frozen=True)
class RewardFunction:
    name: str  # the config's "module:function" (the `reward` label of the metrics)
    fn: RewardFn
    weight: float


class RewardSet:
    """The step's rewards: `score` -> the weighted total and each function's value."""

    def __init__(
        self,
        task: Task,
        specs: list[str],
        weights: list[float],
        timeout_seconds: float = 0.0,
        *,
        non_finite: NonFinite,
    ) -> None:
        self.task = task
        self.timeout_seconds = timeout_seconds  # per call (engine/data/rewardcall.py)
        self.non_finite = non_finite  # what a NaN or inf is: the run's or the eval's decision
        weights = weights or [1.0] * len(specs)
        self.functions = [
            RewardFunction(spec, load_reward(spec), w) for spec, w in zip(specs, weights)
        ]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def score(
        self, prompts: list[Prompt], completions: list[str], group_size: int, first: int = 0
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """`rewards: [samples]` FP32 and {name: [samples]} (empty without `rewards`); sample
        `i` is named `first + i` in errors (under torchrun: its index in the global batch).
        A function that fails raises `RewardError` (engine/data/rewardcall.py). Each call has
        its own time limit; the alarm's handler is installed once for them all."""
        with reward_alarm(self.timeout_seconds):
            return self._score(prompts, completions, group_size, first)

    def _score(
        self, prompts: list[Prompt], completions: list[str], group_size: int, first: int
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        if not self.functions:
            values = [
                self.task.score(
                    prompts[i // group_size],
                    text,
                    first + i,
                    timeout_seconds=self.timeout_seconds,
                    non_finite=self.non_finite,
                )
                for i, text in enumerate(completions)
            ]
            return torch.tensor(values, dtype=torch.float32), {}
        parts: dict[str, list[float]] = {}
        for function in self.functions:
            parts[function.name] = [
                self.task.score(
                    prompts[i // group_size],
                    text,
                    first + i,
                    function.fn,
                    function.name,
                    self.timeout_seconds,
                    non_finite=self.non_finite,
                )
                for i, text in enumerate(completions)
            ]
        total = torch.zeros(len(completions), dtype=torch.float64)
        for function in self.functions:
            total += function.weight * torch.tensor(parts[function.name], dtype=torch.float64)
        return total.float(), parts


def reward_stats(parts: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{name: {"mean", "std"}} (population std) of each function's values."""
    out = {}
    for name, values in parts.items():
        t = torch.tensor(values, dtype=torch.float64)
        out[name] = {"mean": float(t.mean()), "std": float(t.std(correction=0))}
    return out
