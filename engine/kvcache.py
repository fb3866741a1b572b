"""Bounded KV-cache policies for long-context rollouts: the settings and the prefill chunks.

A rollout through `engine.model.kvdecoder.BoundedDecoder` keeps `length` key/value slots per layer
whatever the prompt length. When a chunk of new tokens needs room, the policy evicts:

- `lastrec` (StreamingLLM): the oldest tokens, except the first `sinks` (attention sinks:
  an evicting cache that drops them collapses generation on trained models);
- `h2o` (Heavy-Hitter Oracle): the keys with the least accumulated attention, per layer
  and K/V head, except the sinks and the `grace` most recent tokens.

A prompt longer than the cache is prefilled in chunks of at most `length - protected`
tokens (`chunk_cap`), so a chunk always fits beside the protected slots. For `lastrec` the
keys a query saw are a function of its position, the prompt length and these settings
alone (`engine.train.kvmask.lastrec_visible`): the trainer builds the same visibility into its
attention mask, so it scores what was sampled. For `h2o` they depend on the scores of
every layer and head; the trainer scores with full attention and the step needs truncated
importance sampling (`tis_cap > 0`, checked by `EngineConfig`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

from grpod.engine.errors import EngineError

DEFAULT_MAX_SINKS = 16  # StreamingLLM: a handful of first tokens carry the attention sink


def default_sinks(length: int) -> int:
    """The default sink count for `length` slots: `min(16, length // 8)`."""
    return min(DEFAULT_MAX_SINKS, length // 8)


_Record = TypeVar("_Record", bound="_JsonRecord")


class _JsonRecord:
    """A frozen dataclass as one JSON object (a batch's metadata value) and back."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls: type[_Record], text: str) -> _Record:
        try:
            return cls(**json.loads(text))
        except (json.JSONDecodeError, TypeError) as exc:
            raise EngineError(f"{cls.__name__} {text[:60]!r}: {exc}") from None


@dataclass(frozen=True)
class KVCacheSpec(_JsonRecord):
    """A bounded rollout cache: the policy, slots per layer, sinks and (H2O) grace period."""

    policy: Literal["lastrec", "h2o"]
    length: int  # slots per layer (per row and K/V head)
    sinks: int  # the first `sinks` tokens are never evicted
    grace: int = 0  # h2o: the `grace` most recent tokens are never evicted

    def __post_init__(self) -> None:
        if self.policy not in ("lastrec", "h2o"):
            raise EngineError(f"kv cache policy {self.policy!r}: not lastrec or h2o")
        if self.policy != "h2o" and self.grace:
            raise EngineError(f"kv cache: a grace period is an h2o setting, not {self.policy}'s")
        if min(self.sinks, self.grace) < 0 or self.chunk_cap < 1:
            raise EngineError(
                f"kv cache: length {self.length} leaves no slot beside the {self.protected} "
                f"protected tokens (sinks {self.sinks} + grace {self.grace})"
            )

    @property
    def protected(self) -> int:
        """Tokens no eviction may take: the sinks, and for h2o the grace period."""
        return self.sinks + self.grace

    @property
    def chunk_cap(self) -> int:
        """The longest prefill chunk: it must fit beside the protected slots."""
        return self.length - self.protected


@dataclass(frozen=True)
class CacheStats(_JsonRecord):
    """A rollout's bounded cache after the prefill, over its rows (layers, K/V heads averaged)."""

    prompt_tokens_evicted: float  # summed over rows: prompt tokens the first token did not see
    fill: float  # mean fraction of slots in use


def prefill_chunks(prompt_len: int, spec: KVCacheSpec) -> list[tuple[int, int]]:
    """`(start, size)` of each prefill chunk: the whole prompt when it fits the cache, else
    consecutive chunks of `spec.chunk_cap` tokens (the last one shorter)."""
    if prompt_len <= spec.length:
        return [(0, prompt_len)]
    cap = spec.chunk_cap
    return [(t, min(cap, prompt_len - t)) for t in range(0, prompt_len, cap)]
