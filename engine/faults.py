"""Drill faults as hooks: each known failure (docs/ARCHITECTURE.md), injected on purpose.

The engine calls every hook on every step; with the default `FaultsConfig` each returns its
input untouched, so the trainer's step has no fault branches. `grpod drill` turns one on
(`[engine.faults]`) and checks that the guards intercept it.
"""

from __future__ import annotations

import warnings

import torch

from grpod.base.collectives import local
from grpod.engine.config import FaultsConfig
from grpod.engine.weight_sync import PushFaults

SENTINEL_LOGPROB = -9999.0  # what some backends write for a missing sampler logprob
LOSS_SPIKE_SCALE = 1000.0


class Faults:
    """The hooks of one engine, from its `[engine.faults]` section."""

    def __init__(self, config: FaultsConfig, rank: int = 0) -> None:
        self.config = config
        # under torchrun `ranks` picks where they fire; elsewhere every hook is the identity
        self.active = config.on and (not config.ranks or rank in config.ranks)
        if self.active:
            warnings.warn(
                "grpod engine: FAULT INJECTION IS ON (drill mode); this run corrupts steps "
                "on purpose",
                stacklevel=3,
            )
        steps = {
            "nan-loss": config.nan_loss_steps,
            "inf-grad": config.inf_grad_steps,
            "sentinel-logprob": config.sentinel_logprob_steps,
            "equal-rewards": config.equal_reward_steps,
            "loss-spike": config.loss_spike_steps,
            "sync-skip": config.weight_sync_skip_steps,
            "sync-stale-cache": config.weight_sync_stale_cache_steps,
            "sync-corrupt": config.weight_sync_corrupt_steps,
            "stale-rollout": config.stale_rollout_steps,
        }
        self._steps = {name: frozenset(s if self.active else ()) for name, s in steps.items()}
        # launches are collective under torchrun (a node's server): every rank's, or none
        self._steps["stale-rollout"] = frozenset(config.stale_rollout_steps if config.on else ())

    @property
    def per_micro_accounting(self) -> bool:
        """The counter is re-zeroed per chunk and chunks run in reverse (the wild bug)."""
        return self.active and self.config.accounting != "none"

    def injected(self, step: int) -> tuple[str, ...]:
        """The names of the faults this hook set injects into `step` (sorted)."""
        return tuple(sorted(name for name, steps in self._steps.items() if step in steps))

    def rewards(self, step: int, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """`[samples]` rewards; equal-rewards: every group's rewards equal its first."""
        if step not in self._steps["equal-rewards"]:
            return rewards
        return rewards.reshape(-1, group_size)[:, :1].expand(-1, group_size).reshape(-1).clone()

    def advantages(self, step: int, advantages: torch.Tensor) -> torch.Tensor:
        """`[samples]` advantages; loss-spike: scaled by LOSS_SPIKE_SCALE."""
        if step not in self._steps["loss-spike"]:
            return advantages
        return advantages * LOSS_SPIKE_SCALE

    def sampler_logprobs(self, step: int, logprobs: list[list[float]]) -> list[list[float]]:
        """Per-sample completion logprobs; sentinel-logprob: the first token of the first
        non-empty completion reads SENTINEL_LOGPROB (in place)."""
        if step in self._steps["sentinel-logprob"]:
            first = next(row for row in logprobs if row)
            first[0] = SENTINEL_LOGPROB
        return logprobs

    def micro_loss(self, step: int, micro: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro's loss sum; nan-loss: micro 0's is NaN, which poisons its gradients."""
        if micro != 0 or step not in self._steps["nan-loss"]:
            return loss
        return loss * float("nan")

    def push(self, step: int | None) -> PushFaults:
        """The faults of the weight push before step `step`'s rollout (None: an eval's push,
        never faulted): sync-skip pushes nothing, sync-stale-cache keeps vLLM's prefix cache,
        sync-corrupt shifts one matrix of the push by one element."""
        if step is None:
            return PushFaults()
        return PushFaults(
            skip=step in self._steps["sync-skip"],
            keep_prefix_cache=step in self._steps["sync-stale-cache"],
            corrupt=step in self._steps["sync-corrupt"],
        )

    def early_rollout(self, step: int) -> bool:
        """stale-rollout: step `step`'s rollout is launched one step before the
        max_staleness window reaches it (engine/rollout/ahead.py): it arrives a version too old."""
        return step in self._steps["stale-rollout"]

    def grads(self, step: int, grads: list[torch.Tensor]) -> None:
        """The step's scaled gradients; inf-grad: one element of the first is inf (in place)."""
        if step in self._steps["inf-grad"]:
            local(grads[0]).view(-1)[0] = float("inf")  # a sharded gradient: this rank's shard
