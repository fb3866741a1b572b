"""Drill faults as hooks: each known failure (docs/ARCHITECTURE.md), injected on purpose.

The engine calls every hook on every step; with the default `FaultsConfig` each returns its
input untouched, so the trainer's step has no fault branches. `grpod drill` turns one on
(`[engine.faults]`) and checks that the guards intercept it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpod.base.collectives import local
from grpod.engine.batch import TransportBatch
from grpod.engine.config import FaultsConfig
from grpod.engine.errors import EngineError
from grpod.engine.weight_sync import PushFaults

SENTINEL_LOGPROB = -9999.0  # what some backends write for a missing sampler logprob
LOSS_SPIKE_SCALE = 1000.0
POISON_LOGPROB_SHIFT = -4.0  # nats: logprob-shift's sampler logprobs (e^4 ~ 55x too unlikely)
POISON_LOSS_SCALE = 100.0  # loss-scale: the poisoned sample's per-token loss


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
            "sync-partial": config.weight_sync_partial_steps,
            "stale-rollout": config.stale_rollout_steps,
            "poison-sample": config.poison_sample_steps,
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
        non-empty completion reads SENTINEL_LOGPROB (in place); poison-sample logprob-shift:
        the poisoned sample's all shifted by POISON_LOGPROB_SHIFT (in place)."""
        if step in self._steps["sentinel-logprob"]:
            first = next(row for row in logprobs if row)
            first[0] = SENTINEL_LOGPROB
        index = self.config.poison_sample_index
        if self._poisons(step, "logprob-shift") and index < len(logprobs):
            logprobs[index][:] = [v + POISON_LOGPROB_SHIFT for v in logprobs[index]]
        return logprobs

    def token_loss(
        self, batch: TransportBatch, micro: int, index: torch.Tensor, loss: torch.Tensor
    ) -> torch.Tensor:
        """A chunk's per-token loss `[len(index)]` at the micro's flat positions `index`;
        poison-sample loss-scale: the poisoned sample's tokens scaled by POISON_LOSS_SCALE."""
        if not self._poisons(batch.step, "loss-scale"):
            return loss
        owner = batch.sample_ids[micro].reshape(-1)[index].to(loss.device)
        return torch.where(owner == self.config.poison_sample_index, loss * POISON_LOSS_SCALE, loss)

    @contextmanager
    def trunk(
        self,
        model: torch.nn.Module,
        batch: TransportBatch,
        micros: list[int],
        source: torch.Tensor,
        shape: tuple[int, int],
    ) -> Iterator[None]:
        """Around one trunk pass over `micros` (laid out `shape = (rows', width)`, micro
        position p's state at flat row `source[p]`); poison-sample nan-logits: the poisoned
        sample's completion states are NaN from layer `poison_sample_layer`'s MLP output on
        (a forward hook on that `mlp.down_proj`, its rows and tokens only)."""
        if not self._poisons(batch.step, "nan-logits"):
            yield
            return
        span = slice(micros[0], micros[-1] + 1)
        mine = (batch.sample_ids[span].reshape(-1) == self.config.poison_sample_index) & (
            batch.loss_mask[span].reshape(-1)
        )
        rows = torch.zeros(shape[0] * shape[1] + 1, dtype=torch.bool)
        rows[source[mine.to(source.device)].cpu()] = True  # the last row: positions not run
        poisoned = rows[:-1].reshape(*shape, 1)

        def nan_states(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            where = poisoned.to(out.device)
            return torch.where(where, torch.full_like(out, float("nan")), out)

        hook = poison_module(model, self.config.poison_sample_layer).register_forward_hook(
            nan_states,
            prepend=True,  # the module's own output: observers see it poisoned
        )
        try:
            yield
        finally:
            hook.remove()

    def _poisons(self, step: int, kind: str) -> bool:
        return step in self._steps["poison-sample"] and self.config.poison_sample_kind == kind

    def micro_loss(self, step: int, micro: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro's loss sum; nan-loss: micro 0's is NaN, which poisons its gradients."""
        if micro != 0 or step not in self._steps["nan-loss"]:
            return loss
        return loss * float("nan")

    def push(self, step: int | None) -> PushFaults:
        """The faults of the weight push before step `step`'s rollout (None: an eval's push,
        never faulted): sync-skip pushes nothing, sync-stale-cache keeps vLLM's prefix cache,
        sync-corrupt shifts one matrix of the push by one element, sync-partial leaves one
        out."""
        if step is None:
            return PushFaults()
        return PushFaults(
            skip=step in self._steps["sync-skip"],
            keep_prefix_cache=step in self._steps["sync-stale-cache"],
            corrupt=step in self._steps["sync-corrupt"],
            partial=step in self._steps["sync-partial"],
        )

    def early_rollout(self, step: int) -> bool:
        """stale-rollout: step `step`'s rollout is launched one step before the
        max_staleness window reaches it (engine/rollout/ahead.py): it arrives a version too old."""
        return step in self._steps["stale-rollout"]

    def grads(self, step: int, grads: list[torch.Tensor]) -> None:
        """The step's scaled gradients; inf-grad: one element of the first is inf (in place)."""
        if step in self._steps["inf-grad"]:
            local(grads[0]).view(-1)[0] = float("inf")  # a sharded gradient: this rank's shard


def poison_module(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    """Decoder layer `layer`'s `mlp.down_proj` (its MLP's output, added to the residual)."""
    suffix = f"layers.{layer}.mlp.down_proj"
    for name, module in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            return module
    raise EngineError(f"[engine.faults] poison_sample_layer {layer}: the model has no {suffix}")
