"""A sampled rollout -> the step's `TransportBatch`: rewards, group advantages, packing.

`Engine.rollout` samples (engine/rollout/sampling.py) and hands the completions here; what comes
back is the whole input of the step's trainer side, as the flight recorder keeps it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.config import EngineConfig
from grpod.engine.data.advantages import group_advantages
from grpod.engine.data.audit import AuditSet
from grpod.engine.data.packing import group_samples, pack
from grpod.engine.data.rewards import RewardSet
from grpod.engine.data.tasks import Prompt
from grpod.engine.errors import RewardError
from grpod.engine.faults import Faults
from grpod.engine.model.parallel import Parallel
from grpod.engine.rollout.sampler import Rollout

if TYPE_CHECKING:
    from grpod.engine.kvcache import KVCacheSpec
    from grpod.engine.weight_sync import WeightSyncCheck

__all__ = ["Assembler", "StepInputs"]

# a step's prompts (this rank's whole groups), its first group's index, their token ids
StepInputs = tuple[list[Prompt], int, list[list[int]]]


class Assembler:
    """Scores, normalizes and packs one step's samples (one per prompt x group member)."""

    def __init__(
        self,
        config: EngineConfig,
        rewards: RewardSet,
        faults: Faults,
        parallel: Parallel,
        pad_token_id: int,
        kv_cache: KVCacheSpec | None,
    ) -> None:
        self.config, self.rewards, self.faults, self.parallel = config, rewards, faults, parallel
        self.pad_token_id, self.kv_cache = pad_token_id, kv_cache
        self.config_digest = config.digest()
        self.audits = AuditSet(config, rewards.task, rewards.non_finite)  # never trained on

    def batch(
        self,
        step: int,
        inputs: StepInputs,
        out: Rollout,
        completions: list[list[int]],
        texts: list[str],
        *,
        version: int,
        weight_sync: WeightSyncCheck | None,
        staleness: int | None,
    ) -> TransportBatch:
        """Step `step`'s batch from its sampled completions (and the weight version they were
        sampled with). A failed reward raises its RewardError with the batch packed unscored
        (NaN rewards) for its incident."""
        cfg, faults = self.config, self.faults
        prompts, first, prompt_ids = inputs
        rewards, function_rewards, failure = self._score(prompts, texts, first)
        rewards = faults.rewards(step, rewards, cfg.group_size)
        advantages, _ = group_advantages(
            rewards, cfg.group_size, cfg.scale_rewards, cfg.advantage_std
        )
        advantages = faults.advantages(step, advantages)
        batch = self._pack(
            step,
            out,
            prompt_ids,
            completions,
            rewards,
            advantages,
            first,
            version=version,
            weight_sync=weight_sync,
            staleness=staleness,
        )
        if function_rewards:
            batch = replace(batch, function_rewards=function_rewards)
        if failure is None and self.audits.due(step):
            audits = self.audits.score(step, prompts, texts, cfg.group_size, first * cfg.group_size)
            batch = replace(batch, audit_rewards=audits)
        if failure is not None:
            failure.batch = batch
            raise failure
        return batch

    def unsampled(self, step: int, inputs: StepInputs, version: int) -> TransportBatch:
        """The step's prompts packed without completions (NaN rewards and advantages): what
        a failed rollout's incident keeps (no check of its push came back)."""
        _, first, prompt_ids = inputs
        n = len(prompt_ids) * self.config.group_size
        nothing = Rollout(
            torch.zeros((n, 0), dtype=torch.long),
            torch.zeros((n, 0)),
            torch.zeros((n, 0), dtype=torch.bool),
        )
        nan = torch.full((n,), math.nan)
        empty: list[list[int]] = [[] for _ in range(n)]
        return self._pack(
            step,
            nothing,
            prompt_ids,
            empty,
            nan,
            nan,
            first,
            version=version,
            weight_sync=None,
            staleness=None,
        )

    def _score(
        self, prompts: list[Prompt], texts: list[str], first_group: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], RewardError | None]:
        """`(rewards [samples], per-function rewards, failure)`: a failed reward leaves the
        samples unscored (NaN), packed for its incident."""
        group_size = self.config.group_size
        try:
            rewards, functions = self.rewards.score(
                prompts, texts, group_size, first_group * group_size
            )
        except RewardError as exc:
            return torch.full((len(texts),), math.nan), {}, exc
        return rewards, functions, None

    def _pack(
        self,
        step: int,
        out: Rollout,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        first_group: int,
        *,
        version: int,
        weight_sync: WeightSyncCheck | None,
        staleness: int | None,
    ) -> TransportBatch:
        """The samples packed into the step's `TransportBatch` (engine/data/packing.py)."""
        cfg = self.config
        lengths = out.mask.sum(-1).tolist()
        sampler_logprobs = self.faults.sampler_logprobs(
            step, [row[:n] for row, n in zip(out.logprobs.tolist(), lengths)]
        )
        samples = group_samples(
            prompt_ids,
            completions,
            advantages.tolist(),
            sampler_logprobs,
            cfg.group_size,
            first_group,
        )
        batch = pack(
            samples,
            seq_len=cfg.seq_len,
            micro_batch_rows=cfg.micro_batch_rows,
            pack_rows=cfg.pack,
            pad_token_id=self.pad_token_id,
            rewards=rewards,
            step=step,
            config_digest=self.config_digest,
            sequence_chunks=cfg.sequence_chunks,
            generation=step // cfg.epochs,
            injected_faults=self.faults.injected(step),
        )
        # the rollout's bounded cache travels with the batch: the trainer masks by it
        batch = replace(
            batch,
            kv_cache=self.kv_cache,
            kv_cache_stats=out.cache_stats,
            weight_version=version,
            weight_sync=weight_sync,
            staleness=staleness,
        )
        if self.parallel.distributed:
            batch = replace(batch, rank=self.parallel.rank, world_size=self.parallel.world_size)
        return batch
