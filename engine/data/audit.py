"""Audit rewards and completion statistics: a second opinion of each step, never trained on.

`[engine] audit_rewards = ["mod:f", ...]` are reward functions with the signature of
`rewards` (prompt, completion, answer) -> float, scored on every `audit_every`-th step's
completions and on the held-out eval, carried in the batch (`audit_rewards`) and reported
(`StepReport.audit_rewards`), but never part of the reward the advantages are built from:
a stricter verifier, a format check, a length penalty. The `reward_hacking` guard reads
them beside the trained reward.

`completion_stats(batch)` is what the step's completions say of degeneration, from the
batch's own token ids (no decoding): the fraction of repeated n-grams inside completions and
of identical completions inside groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpod.engine.data.rewardcall import NonFinite
from grpod.engine.data.rewards import RewardSet

if TYPE_CHECKING:
    from grpod.engine.batch import TransportBatch
    from grpod.engine.config import EngineConfig
    from grpod.engine.data.tasks import Prompt, Task

NGRAM = 3  # repeated 3-grams: "the the the", "1 1 1 1"; shorter completions have none


class AuditSet:
    """The run's audit rewards: `score` -> {name: [samples]} on audited steps, else {}."""

    def __init__(self, config: EngineConfig, task: Task, non_finite: NonFinite) -> None:
        self.every = config.audit_every
        self.rewards = RewardSet(
            task,
            list(config.audit_rewards),
            [1.0] * len(config.audit_rewards),
            config.reward_timeout_seconds,
            non_finite=non_finite,
        )

    @property
    def names(self) -> list[str]:
        return self.rewards.names

    def due(self, step: int) -> bool:
        return bool(self.rewards.functions) and step % self.every == 0

    def score(
        self, step: int, prompts: list[Prompt], texts: list[str], group_size: int, first: int = 0
    ) -> dict[str, list[float]]:
        """Each audit reward's value per sample on an audited step; {} on others. A failing
        audit reward raises RewardError as a trained one does (engine/data/rewardcall.py)."""
        if not self.due(step):
            return {}
        return self.rewards.score(prompts, texts, group_size, first)[1]


def completion_stats(batch: TransportBatch) -> dict[str, float]:
    """{"repeated_ngram_fraction", "identical_completion_fraction"} of the step's samples.

    repeated_ngram_fraction: of all 3-grams of completion tokens, the share that repeat an
    earlier 3-gram of the same completion (0 when no completion has 3 tokens).
    identical_completion_fraction: per group, (size - distinct completions) / (size - 1),
    averaged over groups (1: every group sampled one completion; 0: all distinct)."""
    mask = batch.loss_mask.reshape(-1)
    owners = batch.sample_ids.reshape(-1)[mask].tolist()
    tokens = batch.input_ids.reshape(-1)[mask].tolist()
    completions: list[list[int]] = [[] for _ in range(batch.num_samples)]
    for owner, token in zip(owners, tokens):  # packing keeps a sample's tokens in order
        completions[owner].append(token)
    grams = repeated = 0
    for ids in completions:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids) - NGRAM + 1):
            gram = tuple(ids[i : i + NGRAM])
            repeated += gram in seen
            seen.add(gram)
        grams += max(0, len(ids) - NGRAM + 1)
    groups: dict[int, list[tuple[int, ...]]] = {}
    for sample, group in enumerate(batch.sample_group_ids.tolist()):
        groups.setdefault(group, []).append(tuple(completions[sample]))
    identical = [
        (len(members) - len(set(members))) / (len(members) - 1)
        for members in groups.values()
        if len(members) > 1
    ]
    return {
        "repeated_ngram_fraction": repeated / grams if grams else 0.0,
        "identical_completion_fraction": sum(identical) / len(identical) if identical else 0.0,
    }


def audit_means(parts: dict[str, list[float]]) -> dict[str, float]:
    """{name: mean} of each audit reward over the samples (FP64)."""
    return {name: float(torch.tensor(v, dtype=torch.float64).mean()) for name, v in parts.items()}
