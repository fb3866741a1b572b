"""`Sampler`: what a rollout backend is; `Rollout`: the completions it gives back.

Three backends implement the protocol: the torch sampler (torch_sampler.py `TorchSampler`:
the trainer's own rollout copy, batched and KV-cached), colocated vLLM (rollout_vllm.py
`VLLMSampler`) and a vLLM server process (rollout_server.py `ServerSampler`). `Sampling`
(sampling.py) builds the one `rollout_backend` names (`sampler_class`) as
`cls(model, config, probe_tokens)` and drives it through this protocol alone, so a fourth
backend is one module that implements it, and its name in `sampler_class` and the config.
Everything after the `Rollout` (assembly, the batch, training, guards, store and replay) is
the same whichever backend sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from grpod.engine.kvcache import CacheStats
from grpod.engine.weight_sync import ProbeScores, PushFaults


@dataclass(frozen=True)
class SamplingSettings:
    """How every backend samples a step: the budget, the distribution, the stop and the seed."""

    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    eos_token_id: int | list[int]  # any of them ends a completion
    pad_token_id: int
    seed: int  # the step's: request i of a step draws from `request_seed(i)`

    @property
    def stop_ids(self) -> list[int]:
        """The stop tokens as a list (a backend's request field)."""
        eos = self.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos)

    def request_seed(self, index: int) -> int:
        """The seed of a step's `index`-th request: the step's seed plus the index, kept
        within the non-negative int64 a vLLM request takes."""
        return (self.seed + index) % (1 << 63)


@dataclass
class Rollout:
    """One completion per prompt, padded to the longest asked for (`max_new` tokens)."""

    completion_ids: torch.Tensor  # [samples, max_new] int64, pad after the stop
    logprobs: torch.Tensor  # [samples, max_new] FP32 logprob under the sampled distribution
    mask: torch.Tensor  # [samples, max_new] bool: generated tokens up to and including EOS
    cache_stats: CacheStats | None = None  # a bounded KV cache's state after the prefill


class Sampler(Protocol):
    """A rollout backend: it takes the trainer's weights, samples, and scores the probe."""

    @property
    def probe_tokens(self) -> int:
        """The weight-sync probe's length this backend scores (0: it holds no copy to check)."""
        ...

    def push(self, model: torch.nn.Module, faults: PushFaults | None = None) -> tuple[str, ...]:
        """Take `model`'s weights (a backend that samples `model` itself has nothing to do);
        `faults`: the weight-sync drills (engine/faults.py). Returns the sampler's parameters
        the push did not load, where the backend can tell (else ())."""
        ...

    def sample(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        probe: list[int] | None = None,
        beside: Callable[[], None] | None = None,
    ) -> tuple[Rollout, ProbeScores | None]:
        """One completion per prompt, seeded from `settings.seed` (temperature 0 is greedy),
        and the scores of the weight-sync probe when `probe` is given (None otherwise). A
        backend that samples off the caller's thread (the server) runs `beside` on the
        caller's thread once every request is sent, while they are sampled (the check's
        trainer forward); the others never call it."""
        ...

    def close(self) -> None:
        """Let go of what the backend holds (a process, a server it started)."""
        ...
