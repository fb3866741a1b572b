"""The weight-sync check: does the sampler hold the weights the trainer just pushed?

After every push of the trainer's weights into a separate sampler (vLLM), before its rollout
is used, the sampler scores one fixed probe and the trainer scores the same tokens:

- the probe is `probe_tokens` seeded token ids (the same every step of a run), long enough
  to span several of the sampler's KV blocks;
- the sampler scores it twice in one call: a continuation of `CONTINUATION_TOKENS` sampled
  tokens that reads the sampler's prefix cache (stale KV blocks computed with older weights
  show here: an un-reset cache after a sync), then the probe's own prompt logprobs, which
  bypass that cache (wrong weights show here);
- the trainer computes its FP32-head logprobs of the probe and that continuation at
  temperature 1 (`engine.model.head.sequence_logprobs`; the probe's requests sample at
  temperature 1, top-p 1, so the sampler's processed logprobs are its raw ones), and
  `compare` takes the largest absolute difference.

The result, a `WeightSyncCheck`, travels with the step's batch (the guard `weight_sync`
reads it before any compute, and replay sees the same numbers without a sampler).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from grpod.engine.errors import EngineError

CONTINUATION_TOKENS = 8  # sampled after the probe, through the sampler's prefix cache
PROBE_SEED = 0x5EED


@dataclass(frozen=True)
class WeightSyncCheck:
    """One sync's check: the sampler's logprobs of the probe against the trainer's."""

    version: int  # the trainer's weight version pushed (its applied updates)
    max_abs_diff: float  # nats over every compared token; NaN when a logprob is not finite
    position: int  # where in the probe (+ continuation) the largest difference is
    tokens: int  # tokens compared (probe tokens after the first, and the continuation)
    cached_tokens: int  # probe tokens the continuation read from the sampler's prefix cache
    dtype: str  # the trainer's compute dtype (the guard's threshold depends on it)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WeightSyncCheck:
        data = json.loads(text)
        try:
            return cls(
                version=int(data["version"]),
                max_abs_diff=float(data["max_abs_diff"]),
                position=int(data["position"]),
                tokens=int(data["tokens"]),
                cached_tokens=int(data["cached_tokens"]),
                dtype=str(data["dtype"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"weight_sync: {exc!r}") from None


@dataclass(frozen=True)
class PushFaults:
    """Drill faults of one push (`[engine.faults]` weight_sync_*): all off by default."""

    skip: bool = False  # nothing pushed (the sampler keeps its old weights)
    keep_prefix_cache: bool = False  # pushed, but the prefix cache not reset
    corrupt: bool = False  # one matrix of the push arrives shifted by one element


@dataclass(frozen=True)
class ProbeScores:
    """What the sampler said about the probe: the continuation it sampled and the logprobs."""

    continuation: list[int]  # the sampled continuation's ids
    prompt_logprobs: list[float]  # of probe tokens 1.. (token 0 has none)
    continuation_logprobs: list[float]  # of each continuation token
    cached_tokens: int  # probe tokens the continuation request read from the prefix cache


def probe_sequence(length: int, vocab_size: int, low: int = 0) -> list[int]:
    """The run's fixed probe: `length` ids drawn uniformly from `[low, vocab_size)` under a
    fixed seed (so every step scores the same tokens, and they touch the whole embedding)."""
    if length < 2 or vocab_size <= low:
        raise EngineError(f"weight sync probe: {length} tokens over ids [{low}, {vocab_size})")
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(low, vocab_size, (length,), generator=generator).tolist()


def compare(
    probe: list[int],
    scores: ProbeScores,
    trainer: torch.Tensor,
    *,
    version: int,
    dtype: str,
) -> WeightSyncCheck:
    """The check from the sampler's `scores` and the trainer's logprobs of `probe +
    scores.continuation` (`engine.model.head.sequence_logprobs`): position p is token p of
    that sequence."""
    sampler = torch.tensor(
        scores.prompt_logprobs + scores.continuation_logprobs, dtype=torch.float32
    )
    if sampler.shape != trainer.shape:
        raise EngineError(
            f"weight sync probe: the sampler scored {sampler.numel()} tokens, "
            f"the trainer {trainer.numel()}"
        )
    diff = (sampler.double() - trainer.double()).abs()
    finite = torch.isfinite(diff)
    if not bool(finite.all()):  # a NaN or inf logprob on either side: never a pass
        worst, value = int((~finite).nonzero()[0]), math.nan
    else:
        worst = int(diff.argmax())
        value = float(diff[worst])
    return WeightSyncCheck(
        version=version,
        max_abs_diff=value,
        position=worst + 1,
        tokens=int(diff.numel()),
        cached_tokens=scores.cached_tokens,
        dtype=dtype,
    )
