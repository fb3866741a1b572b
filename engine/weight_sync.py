"""The weight-sync check: does the sampler hold the weights the trainer just pushed?

After every push of the trainer's weights into a separate sampler (vLLM), before its rollout
is used, the sampler scores one fixed probe (`probe_tokens` seeded token ids, the same every
step of a run, one KV block and a token long by default) in two requests of the rollout's
own call, both continuing it by `CONTINUATION_TOKENS` greedy tokens:

- the *cached* request reads the sampler's prefix cache: the probe's blocks are cached from
  the last step, so an un-reset cache after a sync serves it KV computed with older weights;
- the *fresh* request asks for the probe's prompt logprobs, which bypass that cache.

Two comparisons, the largest absolute difference of either is the check:

- **the cache**: the cached continuation against the fresh one, token by token (the sampler
  against itself: no trainer compute). A different greedy token is a failed check;
- **the weights**: the trainer's FP32-head logprobs of the probe's first `scored_tokens`
  tokens (`engine.model.head.sequence_logprobs`, temperature 1) against the fresh request's
  prompt logprobs. A few tokens suffice: a skipped, partial or corrupt push moves every
  position's logits, and the trainer's forward is the check's only compute on the trainer.

An on-policy FP32 step compares the weights on its rollout instead (`weights = "rollout"`):
the training forward scores every sampled token at the weights just pushed, so the largest
|vLLM's logprob - the trainer's| over the step's tokens (the report's `mismatch_max`) is the
same comparison over every sampled token (up to 768 at W4) instead of 16, at no forward of
its own. The probe's trainer forward is then skipped, and the check's value holds the cache
half alone until the guard reads the rollout's after the forward (a step is still decided
before its update).

The result, a `WeightSyncCheck`, travels with the step's batch (the guard `weight_sync`
reads it before any compute, the rollout's half after the forward, and replay sees the same
numbers without a sampler).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from grpod.engine.errors import EngineError

# greedy tokens after the probe, cached and fresh: what the stale-cache drill needs on a real
# model (W4: 0.014 nats with 8, 0.00085 with 1, under the 1e-3 limit; bench/README.md)
CONTINUATION_TOKENS = 8
PROBE_SEED = 0x5EED


@dataclass(frozen=True)
class WeightSyncCheck:
    """One sync's check: the sampler's logprobs of the probe against the trainer's."""

    version: int  # the trainer's weight version pushed (its applied updates)
    max_abs_diff: float  # nats over every compared token; NaN when a logprob is not finite
    position: int  # where in the probe (+ continuation) the largest difference is
    tokens: int  # tokens compared (scored probe tokens after the first, and the continuation)
    cached_tokens: int  # probe tokens the continuation read from the sampler's prefix cache
    dtype: str  # the trainer's compute dtype (the guard's threshold depends on it)
    # the sampler's parameters the push did not load (the backends that can tell: vLLM's
    # colocated sampler and grpod's own server; a snapshot-loading server says nothing)
    unloaded: tuple[str, ...] = ()
    # where the weights are compared: "probe" (in `max_abs_diff`), or "rollout" (the step's
    # own tokens in the training forward, the report's `mismatch_max`; `max_abs_diff` then
    # holds the cache half alone)
    weights: str = "probe"

    @property
    def on_rollout(self) -> bool:
        """Whether the training forward of the step's rollout compares the weights."""
        return self.weights == "rollout"

    def with_rollout(self, mismatch_max: float | None) -> float:
        """The whole check's value once the rollout's half is known: the larger of the two
        halves (`mismatch_max`: the step's largest |sampler - trainer| logprob; None, no token
        compared, and a non-finite half are NaN, never a pass). A probe check: its own."""
        if not self.on_rollout:
            return self.max_abs_diff
        halves = (self.max_abs_diff, math.nan if mismatch_max is None else mismatch_max)
        return max(halves) if all(math.isfinite(h) for h in halves) else math.nan

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
                unloaded=tuple(str(name) for name in data.get("unloaded", ())),
                weights=_weights(data.get("weights", "probe")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"weight_sync: {exc!r}") from None


def _weights(value: object) -> str:
    if value not in ("probe", "rollout"):
        raise ValueError(f"weights {value!r}: not 'probe' or 'rollout'")
    return str(value)


@dataclass(frozen=True)
class PushFaults:
    """Drill faults of one push (`[engine.faults]` weight_sync_*): all off by default."""

    skip: bool = False  # nothing pushed (the sampler keeps its old weights)
    keep_prefix_cache: bool = False  # pushed, but the prefix cache not reset
    corrupt: bool = False  # one matrix of the push arrives shifted by one element
    partial: bool = False  # one matrix left out of the push (the sampler keeps its old one)


@dataclass(frozen=True)
class ProbeScores:
    """What the sampler said about the probe: its two greedy continuations and logprobs."""

    continuation: list[int]  # the cached request's continuation ids
    prompt_logprobs: list[float]  # the fresh request's, of probe tokens 1.. (token 0 has none)
    continuation_logprobs: list[float]  # the cached request's, of each continuation token
    cached_tokens: int  # probe tokens the cached request read from the prefix cache
    fresh_continuation: list[int]  # the fresh request's continuation ids
    fresh_logprobs: list[float]  # the fresh request's, of each of its continuation tokens


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
    trainer: torch.Tensor | None,
    *,
    version: int,
    dtype: str,
    unloaded: tuple[str, ...] = (),
) -> WeightSyncCheck:
    """The check from the sampler's `scores` and the trainer's logprobs of the probe's first
    `len(trainer) + 1` tokens (`engine.model.head.sequence_logprobs`); `trainer` None: the
    cache half alone, the weights compared on the step's rollout (`weights = "rollout"`).
    Position p is token p of the probe, then of the continuation after it."""
    # float32 to float: exact, so the differences are float64's
    values = [] if trainer is None else trainer.tolist()
    scored = len(values)
    if scored > len(scores.prompt_logprobs) or len(scores.prompt_logprobs) != len(probe) - 1:
        raise EngineError(
            f"weight sync probe: the sampler scored {len(scores.prompt_logprobs)} of "
            f"{len(probe)} probe tokens, the trainer {scored}"
        )
    # a few dozen floats: Python's own arithmetic, not a dozen torch calls on tiny tensors
    diff = [abs(s - t) for s, t in zip(scores.prompt_logprobs, values)] + _cache_diff(scores)
    not_finite = [i for i, d in enumerate(diff) if not math.isfinite(d)]
    if not_finite:  # NaN or inf on either side, or other tokens: never a pass
        worst, value = not_finite[0], math.nan
    else:
        value = max(diff)
        worst = diff.index(value)  # the first of equal differences
    # the continuation's positions come after the whole probe's
    position = worst + 1 if worst < scored else len(probe) + worst - scored
    return WeightSyncCheck(
        version=version,
        max_abs_diff=value,
        position=position,
        tokens=len(diff),
        cached_tokens=scores.cached_tokens,
        dtype=dtype,
        unloaded=unloaded,
        weights="probe" if trainer is not None else "rollout",
    )


def _cache_diff(scores: ProbeScores) -> list[float]:
    """|cached - fresh| logprob per continuation token; NaN from the first token where the
    two greedy continuations differ (their logits differ there: a failed check)."""
    cached, fresh = scores.continuation, scores.fresh_continuation
    n = len(cached)
    if len(fresh) != n or len(scores.continuation_logprobs) != n or len(scores.fresh_logprobs) != n:
        raise EngineError(
            f"weight sync probe: continuations of {n} and {len(fresh)} tokens "
            f"({len(scores.continuation_logprobs)} and {len(scores.fresh_logprobs)} logprobs)"
        )
    diff = [abs(c - f) for c, f in zip(scores.continuation_logprobs, scores.fresh_logprobs)]
    first = next((t for t in range(n) if cached[t] != fresh[t]), n)
    return diff[:first] + [math.nan] * (n - first)
