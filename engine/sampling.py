"""`Sampling`: completions from the rollout copy of the policy, and the weight sync before them.

The torch sampler (engine/torch_sampler.py) runs in-process on `rollout_model`; with
`rollout_backend = "vllm"` (engine/rollout_vllm.py) or `"vllm-server"`
(engine/rollout_server.py) the weights are pushed into vLLM first (started on first use)
and its rollout also scores the weight-sync probe, which the trainer checks
(engine/weight_sync.py). Completions end at a stop token or stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from grpod.engine.build import EngineParts
from grpod.engine.config import VLLM_BACKENDS, EngineConfig
from grpod.engine.faults import Faults
from grpod.engine.layout import sequence_logprobs
from grpod.engine.parallel import Parallel
from grpod.engine.phases import PhaseClock
from grpod.engine.stop_strings import cut_at_stop_strings, strip_stop_strings
from grpod.engine.torch_sampler import Rollout, sample
from grpod.engine.weight_sync import ProbeScores, WeightSyncCheck, compare, probe_sequence

if TYPE_CHECKING:  # imported on first use: vllm is an extra
    from grpod.engine.rollout_server import ServerSampler
    from grpod.engine.rollout_vllm import VLLMSampler


class Sampling:
    """Sample completions from `rollout_model` (the unsharded copy of the trained `model`)."""

    def __init__(
        self,
        config: EngineConfig,
        parts: EngineParts,
        parallel: Parallel,
        faults: Faults,
        clock: PhaseClock,
        weight_version: Callable[[], int],
    ) -> None:
        self.config, self.model, self.rollout_model = config, parts.model, parts.rollout_model
        self.tokenizer, self.stop_token_ids = parts.tokenizer, parts.stop_token_ids
        self.kv_cache, self.device = parts.kv_cache, parts.device
        self.parallel, self.faults, self.clock = parallel, faults, clock
        self.weight_version = weight_version
        # rollout_backend vllm / vllm-server: built on first use (or by `start`)
        self.vllm: VLLMSampler | ServerSampler | None = None
        self.weight_sync: WeightSyncCheck | None = None  # the last push's check (vllm)
        self.probe: list[int] = []  # the weight-sync probe (engine/weight_sync.py)

    def generate(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None = None,
        *,
        step: int | None = None,
    ) -> tuple[Rollout, list[list[int]], list[str]]:
        """Sample one completion per prompt: the rollout (ended at a stop token or string),
        each completion's ids and the text its rewards see (before any stop string).
        `step`: the training step this rollout is for (its drill faults); None for an eval."""
        if self.parallel.sharded:  # the rollout copy takes the shards' current weights
            with self.clock.timed("sync"):
                self.parallel.sync_rollout_copy(self.model, self.rollout_model)
        if self.config.rollout_backend in VLLM_BACKENDS:
            self._push_to_sampler(step)
        out = cut_at_stop_strings(
            self._sample(prompts, seed, temperature), self.tokenizer, self.config.stop
        )
        lengths = out.mask.sum(-1).tolist()
        completions = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        texts = [
            strip_stop_strings(self.tokenizer.decode(ids), self.config.stop) for ids in completions
        ]
        return out, completions, texts

    def _sample(self, prompts: list[list[int]], seed: int, temperature: float | None) -> Rollout:
        """Completions from the configured backend: the torch sampler, or vLLM (whose call
        also scores the weight-sync probe; its check is the `sync_check` phase)."""
        cfg = self.config
        settings = dict(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if self.vllm is not None:  # pushed by `_push_to_sampler`
            rollout, scores = self.vllm.sample(prompts, seed=seed, probe=self.probe, **settings)
            self.weight_sync = self._check_sampler(scores)
            return rollout
        generator = torch.Generator(self.device).manual_seed(seed)
        return sample(
            self.rollout_model,
            prompts,
            generator=generator,
            dtype=cfg.dtype,
            decoder=cfg.rollout_decoder,
            kv_cache=self.kv_cache,
            **settings,
        )

    def _push_to_sampler(self, step: int | None) -> None:
        """Push the rollout model's weights into vLLM (started on first use); its rollout
        then scores the weight-sync probe (engine/weight_sync.py)."""
        self.start()
        with self.clock.timed("sync"):
            self.vllm.push(self.rollout_model, self.faults.push(step))

    def start(self) -> None:
        """Start the vLLM sampler the config names: colocated, or a server process (a no-op
        once started, and for the torch sampler)."""
        cfg = self.config
        if self.vllm is not None or cfg.rollout_backend not in VLLM_BACKENDS:
            return
        if cfg.rollout_backend == "vllm-server":
            from grpod.engine.rollout_server import ServerSampler as Sampler
        else:
            from grpod.engine.rollout_vllm import VLLMSampler as Sampler
        vocab = min(self.tokenizer.vocab_size, self.model.get_input_embeddings().num_embeddings)
        self.vllm = Sampler(self.rollout_model, cfg, cfg.weight_sync_probe_tokens)
        self.probe = probe_sequence(self.vllm.probe_tokens, vocab)

    def close(self) -> None:
        """Stop the vLLM sampler (a server process grpod started stops with it)."""
        sampler, self.vllm = self.vllm, None
        if sampler is not None:
            sampler.close()

    def _check_sampler(self, scores: ProbeScores) -> WeightSyncCheck:
        """vLLM's logprobs of the probe (and its continuation) against the trainer's."""
        with self.clock.timed("sync_check"):
            trainer = sequence_logprobs(
                self.rollout_model,
                self.probe + scores.continuation,
                self.config.dtype,
                self.device,
            )
            return compare(
                self.probe,
                scores,
                trainer,
                version=self.weight_version(),
                dtype=self.config.dtype,
            )
