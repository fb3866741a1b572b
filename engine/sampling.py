"""`Sampling`: completions from the rollout copy of the policy, and the weight sync before them.

The torch sampler (engine/torch_sampler.py) runs in-process on `rollout_model`; with
`rollout_backend = "vllm"` (engine/rollout_vllm.py) or `"vllm-server"`
(engine/rollout_server.py) the weights are pushed into vLLM first (started on first use)
and its rollout also scores the weight-sync probe, which the trainer checks
(engine/weight_sync.py). Completions end at a stop token or stop string.

Async steps (`max_staleness > 0`, engine/ahead.py) `submit` rollouts ahead of the step
that trains on them. With a vllm-server the push and its check run at submission, while
the sampler is idle and the trainer still holds the pushed weights, and the sampling itself
runs on a background thread (the server computes; the trainer trains meanwhile); every
other backend samples in this process, at submission, with no overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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


class Pending:
    """One rollout, sampled or in flight: the weight version it samples with, that push's
    weight-sync check (vLLM), and its result once done."""

    def __init__(
        self, future: Future[Rollout], version: int, weight_sync: WeightSyncCheck | None
    ) -> None:
        self.future, self.version, self.weight_sync = future, version, weight_sync
        self.inputs: Any = None  # what it was launched for (the engine's step prompts)
        self.sample_seconds = 0.0  # the sampling's own wall-clock seconds
        self.waited_seconds = 0.0  # how long the trainer waited for it

    @classmethod
    def done(cls, rollout: Rollout, version: int, weight_sync: WeightSyncCheck | None) -> Pending:
        future: Future[Rollout] = Future()
        future.set_result(rollout)
        return cls(future, version, weight_sync)

    def result(self) -> Rollout:
        """The rollout (a SamplerError raised while sampling is raised here)."""
        started = time.perf_counter()
        try:
            return self.future.result()
        finally:
            self.waited_seconds += time.perf_counter() - started

    @property
    def overlap_seconds(self) -> float:
        """The sampling's seconds the trainer did not wait for: run beside its work."""
        return max(0.0, self.sample_seconds - self.waited_seconds)


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
        # async steps with a server: its rollouts sample on one background thread
        self.background = config.max_staleness > 0 and config.rollout_backend == "vllm-server"
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: list[Pending] = []

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
        self.drain()  # the sampler is this call's alone
        return self.finish(self._sample_now(prompts, seed, temperature, step))

    def submit(self, prompts: list[list[int]], seed: int, *, step: int) -> Pending:
        """Step `step`'s rollout at the weights the policy has now: sampled now, or (async
        steps with a server) in flight on the background thread once pushed and checked."""
        version = self.weight_version()
        if not self.background:
            rollout = self._sample_now(prompts, seed, None, step)
            return Pending.done(rollout, version, self.weight_sync)
        self.drain()  # a push must not land under a rollout in flight
        self._push_to_sampler(step)
        settings = self._settings(None)
        _, scores = self.vllm.sample([], seed=seed, probe=self.probe, **settings)
        check = self._check_sampler(scores)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        future: Future[Rollout] = Future()
        pending = Pending(future, version, check)

        def run() -> None:
            started = time.perf_counter()
            try:
                rollout, _ = self.vllm.sample(prompts, seed=seed, **settings)
            except BaseException as exc:  # raised again where the rollout is taken
                future.set_exception(exc)
            else:
                future.set_result(rollout)
            finally:
                pending.sample_seconds = time.perf_counter() - started

        self._worker.submit(run)
        self._in_flight.append(pending)
        return pending

    def drain(self) -> None:
        """Wait for the rollouts in flight (their errors stay with them)."""
        in_flight, self._in_flight = self._in_flight, []
        for pending in in_flight:
            with contextlib.suppress(BaseException):  # raised again where it is taken
                pending.result()

    def finish(self, rollout: Rollout) -> tuple[Rollout, list[list[int]], list[str]]:
        """A rollout ended at its stop strings, each completion's ids and its reward text."""
        out = cut_at_stop_strings(rollout, self.tokenizer, self.config.stop)
        lengths = out.mask.sum(-1).tolist()
        completions = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        texts = [
            strip_stop_strings(self.tokenizer.decode(ids), self.config.stop) for ids in completions
        ]
        return out, completions, texts

    def _sample_now(
        self, prompts: list[list[int]], seed: int, temperature: float | None, step: int | None
    ) -> Rollout:
        if self.parallel.sharded:  # the rollout copy takes the shards' current weights
            with self.clock.timed("sync"):
                self.parallel.sync_rollout_copy(self.model, self.rollout_model)
        if self.config.rollout_backend in VLLM_BACKENDS:
            self._push_to_sampler(step)
        return self._sample(prompts, seed, temperature)

    def _settings(self, temperature: float | None) -> dict:
        cfg = self.config
        return dict(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def _sample(self, prompts: list[list[int]], seed: int, temperature: float | None) -> Rollout:
        """Completions from the configured backend: the torch sampler, or vLLM (whose call
        also scores the weight-sync probe; its check is the `sync_check` phase)."""
        cfg = self.config
        settings = self._settings(temperature)
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
        """Stop the vLLM sampler (a server process grpod started stops with it); rollouts
        still in flight fail with it and are dropped."""
        sampler, self.vllm = self.vllm, None
        if sampler is not None:
            sampler.close()
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)

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
