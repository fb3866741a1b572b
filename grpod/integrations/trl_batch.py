"""TRL's optimizer step as grpod's contracts, and back.

The micro-batches `GRPOTrainer.training_step` ran (`_prepare_inputs`' output: `prompt_ids,
prompt_mask` `[rows, P]` left-padded, `completion_ids, completion_mask` `[rows, C]`
right-padded, `advantages` `[rows]`, `num_items_in_batch`, optional old/sampling logprobs)
become one `TransportBatch` `[micros, rows, seq]` whose rows are `[prompt | completion | pad]`
and whose `segments` keep each micro's `(P, C)`; `micro_inputs` rebuilds TRL's exact inputs
from it (replay). `step_report` turns the micros' losses, TRL's per-micro metrics, the grad
norm and the generation's gathered rewards into a `StepReport`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.errors import EngineError
from grpod.engine.report import StepReport
from grpod.engine.train.stats import clip_coefficient, mismatch_stats

SAMPLE_INDEX = "grpod_sample_index"  # added to TRL's generation output: each row's global index
LOGPROB_KEYS = {"old_per_token_logps": "old_logprobs", "sampling_per_token_logps": "sampler"}


@dataclass
class Micro:
    """One micro-batch as `_compute_loss` took it, and what TRL said about it."""

    inputs: dict[str, torch.Tensor]  # detached, on the CPU; without SAMPLE_INDEX
    sample_index: torch.Tensor  # [rows] int64: each row's index in the gathered generation
    loss: float = math.nan  # training_step's returned loss (TRL's scaling)
    metrics: dict[str, float] = field(default_factory=dict)  # TRL's per-micro metrics


@dataclass(frozen=True)
class Generation:
    """The gathered rewards of the generation batch the micros were cut from."""

    function_rewards: torch.Tensor  # [global samples, functions] float32, NaN = not scored
    weights: torch.Tensor  # [functions]
    names: tuple[str, ...]
    num_generations: int

    @property
    def rewards(self) -> torch.Tensor:
        """[global samples] weighted sum, NaN where no function scored the sample."""
        total = (self.function_rewards * self.weights.unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(self.function_rewards).all(dim=1)] = math.nan
        return total


def to_transport_batch(
    micros: list[Micro],
    generation: Generation,
    *,
    step: int,
    config_digest: str,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
) -> TransportBatch:
    """The step's micros as one batch of `seq_len` columns (>= every micro's P + C)."""
    rows = int(micros[0].inputs["prompt_ids"].shape[0])
    shape = (len(micros), rows, seq_len)
    ids = torch.zeros(shape, dtype=torch.int64)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    attended = torch.zeros(shape, dtype=torch.bool)
    advantages = torch.zeros(shape, dtype=torch.float32)
    logprobs = {k: torch.zeros(shape, dtype=torch.float32) for k in LOGPROB_KEYS}
    present = {k: k in micros[0].inputs for k in LOGPROB_KEYS}
    segments = []
    for m, micro in enumerate(micros):
        x = micro.inputs
        p, c = int(x["prompt_ids"].shape[1]), int(x["completion_ids"].shape[1])
        if x["prompt_ids"].shape[0] != rows or p + c > seq_len:
            raise EngineError(f"TRL step {step}: micro {m} is {tuple(x['prompt_ids'].shape)}")
        segments.append((p, c))
        ids[m, :, :p], ids[m, :, p : p + c] = x["prompt_ids"], x["completion_ids"]
        attended[m, :, :p] = x["prompt_mask"].bool()
        attended[m, :, p : p + c] = x["completion_mask"].bool()
        loss_mask[m, :, p : p + c] = x["completion_mask"].bool()
        adv = x["advantages"].float()
        advantages[m, :, p : p + c] = adv.unsqueeze(1) if adv.dim() == 1 else adv
        for key in LOGPROB_KEYS:
            if present[key]:
                logprobs[key][m, :, p : p + c] = x[key].float()
    index = torch.cat([micro.sample_index for micro in micros])
    samples = torch.arange(index.numel(), dtype=torch.int32).reshape(len(micros), rows, 1)
    groups = (index // generation.num_generations).to(torch.int32)
    completion = torch.cat([micro.inputs["completion_mask"].sum(-1) for micro in micros])
    function_rewards = generation.function_rewards[index]
    return TransportBatch(
        input_ids=ids,
        position_ids=((attended.cumsum(-1) - 1).clamp(min=0) * attended).to(torch.int64),
        loss_mask=loss_mask,
        advantages=advantages,
        sampler_logprobs=logprobs["sampling_per_token_logps"]
        if present["sampling_per_token_logps"]
        else None,
        sample_ids=torch.where(attended, samples, -1).to(torch.int32),
        group_ids=torch.where(attended, groups.reshape(len(micros), rows, 1), -1).to(torch.int32),
        rewards=generation.rewards[index].float(),
        sample_group_ids=groups,
        completion_lengths=completion.to(torch.int32),
        step=step,
        config_digest=config_digest,
        old_logprobs=logprobs["old_per_token_logps"] if present["old_per_token_logps"] else None,
        function_rewards={
            name: function_rewards[:, i].tolist() for i, name in enumerate(generation.names)
        },
        rank=rank,
        world_size=world_size,
        segments=tuple(segments),
    )


def micro_inputs(batch: TransportBatch, num_items_in_batch: int) -> list[dict[str, torch.Tensor]]:
    """TRL's inputs of each micro of `batch`, exactly as `_compute_loss` took them."""
    if len(batch.segments) != batch.num_micros:
        raise EngineError(f"batch step {batch.step}: not a TRL batch (no segments)")
    out = []
    for m, (p, c) in enumerate(batch.segments):
        ids = batch.input_ids[m, :, : p + c]
        attended = batch.sample_ids[m, :, : p + c] >= 0
        x = {
            "prompt_ids": ids[:, :p].clone(),
            "prompt_mask": attended[:, :p].long(),
            "completion_ids": ids[:, p:].clone(),
            "completion_mask": batch.loss_mask[m, :, p : p + c].long(),
            "advantages": batch.advantages[m, :, p].clone(),
            "num_items_in_batch": torch.tensor(num_items_in_batch),
        }
        if batch.old_logprobs is not None:
            x["old_per_token_logps"] = batch.old_logprobs[m, :, p : p + c].clone()
        if batch.sampler_logprobs is not None:
            x["sampling_per_token_logps"] = batch.sampler_logprobs[m, :, p : p + c].clone()
        out.append(x)
    return out


@dataclass(frozen=True)
class StepTotals:
    """The step's numbers that are not per micro, the same on every rank."""

    step: int
    lr: float
    grad_norm: float  # pre-clip, over the synced gradients
    max_grad_norm: float
    valid_tokens: int  # TRL's num_items_in_batch: the global divisor of its loss
    expected_valid_tokens: int  # global Σ completion_mask of the step's micros
    rank_expected_valid_tokens: list[int]  # each rank's Σ completion_mask
    loss: float  # mean over ranks of each rank's Σ micro losses (dapo: Σ token loss / N)
    rank: int = 0
    world_size: int = 1


def step_report(
    batch: TransportBatch, micros: list[Micro], gen: Generation, t: StepTotals
) -> StepReport:
    """The `StepReport` of a TRL step (reward statistics over the gathered generation)."""
    mask = batch.loss_mask
    tokens = [float(micro.inputs["completion_mask"].sum()) for micro in micros]
    rewards = gen.rewards
    grouped = rewards.reshape(-1, gen.num_generations)
    zero_std = _nan_std(grouped, dim=1).isclose(torch.zeros(grouped.shape[0])).float().mean()
    lengths = batch.completion_lengths.float()
    return StepReport(
        step=t.step,
        valid_tokens=t.valid_tokens,
        expected_valid_tokens=t.expected_valid_tokens,
        loss=t.loss,
        micro_losses=[micro.loss for micro in micros],
        grad_norm=t.grad_norm,
        clip_coef=clip_coefficient(t.grad_norm, t.max_grad_norm),
        lr=t.lr,
        reward_mean=float(torch.nanmean(rewards)),
        reward_std=float(_nan_std(rewards, dim=0)),
        zero_std_group_fraction=float(zero_std),
        advantage_abs_max=float(batch.advantages[mask].abs().max()) if mask.any() else 0.0,
        kl=_weighted(micros, tokens, "kl"),
        clip_fraction_low=_weighted(micros, tokens, "clip_ratio/low_mean") or 0.0,
        clip_fraction_high=_weighted(micros, tokens, "clip_ratio/high_mean") or 0.0,
        completion_length_mean=float(lengths.mean()),
        completion_length_max=int(lengths.max()),
        num_micros=batch.num_micros,
        num_samples=batch.num_samples,
        micro_order=list(range(batch.num_micros)),
        entropy=_weighted(micros, tokens, "entropy"),
        reward_functions={
            name: {
                "mean": float(torch.nanmean(gen.function_rewards[:, i])),
                "std": float(_nan_std(gen.function_rewards[:, i], dim=0)),
            }
            for i, name in enumerate(gen.names)
        },
        rank=t.rank,
        world_size=t.world_size,
        global_valid_tokens=t.valid_tokens if t.world_size > 1 else None,
        rank_expected_valid_tokens=t.rank_expected_valid_tokens if t.world_size > 1 else [],
        local_loss=math.fsum(micro.loss for micro in micros) if t.world_size > 1 else None,
        **_mismatch(batch),
    )


def _weighted(micros: list[Micro], tokens: list[float], name: str) -> float | None:
    """TRL's per-micro metric `name`, weighted by each micro's trainable tokens."""
    pairs = [(m.metrics[name], w) for m, w in zip(micros, tokens) if name in m.metrics]
    total = math.fsum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    return math.fsum(v * w for v, w in pairs) / total


def _nan_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Population std ignoring NaN (grpod reports the population std)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    return torch.nanmean((x - mean) ** 2, dim=dim).sqrt()


def _mismatch(batch: TransportBatch) -> dict[str, float | None]:
    """|sampler - trainer| logprob stats over trainable tokens (vLLM's sampling logprobs vs
    TRL's old logprobs); None without both."""
    if batch.sampler_logprobs is None or batch.old_logprobs is None:
        return mismatch_stats(None, None)
    mask = batch.loss_mask
    return mismatch_stats(batch.sampler_logprobs[mask], batch.old_logprobs[mask])
