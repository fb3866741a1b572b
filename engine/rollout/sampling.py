"""`Sampling`: completions from the rollout copy of the policy, and the weight sync before them.

Every backend is a `Sampler` (engine/rollout/sampler.py), built by `sampler_class`. The torch
sampler (engine/rollout/torch_sampler.py) runs in-process on `rollout_model`; with
`rollout_backend = "vllm"` (engine/rollout/rollout_vllm.py) or `"vllm-server"`
(engine/rollout/rollout_server.py) the weights are pushed into vLLM first (started on first use)
and its rollout also scores the weight-sync probe, which the trainer checks
(engine/weight_sync.py). Completions end at a stop token or stop string.

Async steps (`max_staleness > 0`, engine/rollout/ahead.py) `submit` rollouts ahead of the step
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
from typing import Any, Protocol

import torch

from grpod.engine.config import VLLM_BACKENDS, EngineConfig
from grpod.engine.errors import EngineError, SamplerError
from grpod.engine.faults import Faults
from grpod.engine.model.head import sequence_logprobs
from grpod.engine.model.parallel import Parallel
from grpod.engine.phases import PhaseClock
from grpod.engine.rollout.sampler import Rollout, Sampler, SamplingSettings
from grpod.engine.rollout.stop_strings import cut_at_stop_strings, strip_stop_strings
from grpod.engine.rollout.torch_sampler import TorchSampler
from grpod.engine.weight_sync import ProbeScores, WeightSyncCheck, compare, probe_sequence


def sampler_class(backend: str) -> type[Sampler]:
    """The `Sampler` of `rollout_backend = backend`, built as `cls(model, config,
    probe_tokens)`; vLLM's modules are imported only when asked for (vllm is an extra)."""
    if backend == "vllm-server":
        from grpod.engine.rollout.rollout_server import ServerSampler

        return ServerSampler
    if backend == "vllm":
        from grpod.engine.rollout.rollout_vllm import VLLMSampler

        return VLLMSampler
    if backend == "torch":
        return TorchSampler
    raise EngineError(f"rollout_backend {backend!r}: no such sampler")


class Pending:
    """One rollout, sampled or in flight: the weight version it samples with, that push's
    weight-sync check (vLLM), and its result once done."""

    def __init__(
        self,
        future: Future[Rollout],
        version: int,
        weight_sync: WeightSyncCheck | None,
        agree: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.future, self.version, self.weight_sync = future, version, weight_sync
        self.inputs: Any = None  # what it was launched for (the engine's step prompts)
        self.sample_seconds = 0.0  # the sampling's own wall-clock seconds
        self.waited_seconds = 0.0  # how long the trainer waited for it
        # a node's server under torchrun: every rank's outcome agreed on the first take
        self._agree, self._failure = agree, None

    @classmethod
    def done(cls, rollout: Rollout, version: int, weight_sync: WeightSyncCheck | None) -> Pending:
        future: Future[Rollout] = Future()
        future.set_result(rollout)
        return cls(future, version, weight_sync)

    def result(self) -> Rollout:
        """The rollout (a SamplerError raised while sampling is raised here; under a node's
        server, a peer rank's too: every rank's sampling of the step agreed on first take)."""
        self.wait()
        if self._agree is not None:
            agree, self._agree = self._agree, None
            try:
                agree(self.future.exception())
            except SamplerError as exc:
                self._failure = exc
        if self._failure is not None:
            raise self._failure
        return self.future.result()

    def wait(self) -> None:
        """Wait until it is sampled (or failed), counting the wait as the trainer's."""
        started = time.perf_counter()
        with contextlib.suppress(BaseException):
            self.future.exception()
        self.waited_seconds += time.perf_counter() - started

    @property
    def overlap_seconds(self) -> float:
        """The sampling's seconds the trainer did not wait for: run beside its work."""
        return max(0.0, self.sample_seconds - self.waited_seconds)


class RolloutParts(Protocol):
    """What sampling takes of the engine's parts (engine/grpo/build.py `EngineParts` holds
    them): not the task, rewards, KL reference or training trunk, which are training's."""

    @property
    def model(self) -> torch.nn.Module: ...  # the trained model (FSDP-sharded, or plain)
    @property
    def rollout_model(self) -> torch.nn.Module: ...  # its unsharded copy: what samples
    @property
    def tokenizer(self) -> Any: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def device(self) -> torch.device: ...


class Sampling:
    """Sample completions from `rollout_model` (the unsharded copy of the trained `model`)."""

    def __init__(
        self,
        config: EngineConfig,
        parts: RolloutParts,
        parallel: Parallel,
        faults: Faults,
        clock: PhaseClock,
        weight_version: Callable[[], int],
    ) -> None:
        self.config, self.model, self.rollout_model = config, parts.model, parts.rollout_model
        self.tokenizer, self.stop_token_ids = parts.tokenizer, parts.stop_token_ids
        self.device = parts.device
        self.parallel, self.faults, self.clock = parallel, faults, clock
        self.weight_version = weight_version
        # rollout_backend vllm / vllm-server: built on first use (or by `start`)
        self.vllm: Sampler | None = None
        self.torch_sampler = TorchSampler(self.rollout_model, config)  # the in-process backend
        self.weight_sync: WeightSyncCheck | None = None  # the last push's check (vllm)
        self._unloaded: tuple[str, ...] = ()  # the last push's parameters the sampler kept
        self.probe: list[int] = []  # the weight-sync probe (engine/weight_sync.py)
        server = config.rollout_backend == "vllm-server"
        # async steps with a server: its rollouts sample on one background thread
        self.background = config.max_staleness > 0 and server
        # under torchrun: one server per node, started and fed by its local rank 0
        self.node_server = server and parallel.distributed
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
            rollout = self._sample_now(prompts, seed, None, step, trained=True)
            return Pending.done(rollout, version, self.weight_sync)
        self.drain()  # a push must not land under a rollout in flight
        self._refresh_copy()
        check = self._push_and_check(step, seed, on_rollout=False)
        settings = self._settings(None, seed)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        future: Future[Rollout] = Future()
        pending = Pending(future, version, check, self._agree if self.node_server else None)

        def run() -> None:
            started = time.perf_counter()
            try:
                rollout, _ = self.vllm.sample(prompts, settings)
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
            pending.wait()  # its error is raised where it is taken

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
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None,
        step: int | None,
        trained: bool = False,
    ) -> Rollout:
        """`trained`: the rollout is trained on now, at the weights it samples with."""
        self._refresh_copy()
        on_rollout = trained and self.weights_on_rollout
        if self.node_server:  # pushed and checked once for the node; every rank samples
            self.weight_sync = self._push_and_check(step, seed, on_rollout)
            try:
                rollout, failure = self._sample(prompts, seed, temperature, probe=False), None
            except SamplerError as exc:
                rollout, failure = None, exc
            self._agree(failure)
            if failure is not None:
                raise failure
            return rollout
        if self.config.rollout_backend in VLLM_BACKENDS:
            self._push_to_sampler(step)
        return self._sample(prompts, seed, temperature, on_rollout=on_rollout)

    @property
    def weights_on_rollout(self) -> bool:
        """Whether an on-policy step's training forward compares the pushed weights on its
        rollout (the probe's trainer forward skipped; `weight_sync_on_rollout`): FP32, one
        epoch a generation (a later epoch's forward compares nothing), no rollout sampled
        ahead. In FP32 the two agree to rounding on every token (W4: at most 7.0e-5 nats over
        a step's up to 768), so the rollout's largest difference tests what the probe's 16
        tokens did; in bf16 the largest of a step's rounding differences is not calibrated
        (the probe's 16 are)."""
        cfg = self.config
        on_policy = cfg.epochs == 1 and cfg.max_staleness == 0
        return cfg.weight_sync_on_rollout and cfg.dtype == "float32" and on_policy

    def _refresh_copy(self) -> None:
        if self.parallel.sharded:  # the rollout copy takes the shards' current weights
            with self.clock.timed("sync"):
                self.parallel.sync_rollout_copy(self.model, self.rollout_model)

    def _push_and_check(self, step: int | None, seed: int, on_rollout: bool) -> WeightSyncCheck:
        """Push the weights, then have the sampler score the weight-sync probe on its own and
        check it (the rollout follows; `on_rollout`: its training forward compares the
        weights). A node's server: once every rank's rollouts on it have ended, local rank 0
        pushes and checks, and every rank of the node takes that check (or that failure)."""
        self.start()
        if not self.node_server:
            self._push_to_sampler(step)
            return self._probe_check(seed, on_rollout)
        self.parallel.barrier()  # no rank of the node has a request in flight

        def push_and_check() -> WeightSyncCheck:
            self._push_to_sampler(step)
            return self._probe_check(seed, on_rollout)

        return on_node_leader(self.parallel, push_and_check)

    def _probe_check(self, seed: int, on_rollout: bool) -> WeightSyncCheck:
        _, scores = self.vllm.sample([], self._settings(None, seed), probe=self.probe)
        return self._check_sampler(scores, None if on_rollout else self._score_probe())

    def _agree(self, failure: BaseException | None) -> None:
        """A node's server: whether every rank sampled its part of the step (one MAX
        all-reduce); a peer's failure fails this rank's step too, so no rank trains a step
        its peers do not."""
        if self.parallel.max_int(failure is not None) and failure is None:
            raise SamplerError(
                "the node's rollout server failed a peer rank's rollout (that rank's line says how)"
            )

    def _settings(self, temperature: float | None, seed: int) -> SamplingSettings:
        cfg = self.config
        return SamplingSettings(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            seed=seed,
        )

    def _sample(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None,
        probe: bool = True,
        on_rollout: bool = False,
    ) -> Rollout:
        """Completions from the configured backend: the torch sampler, or vLLM (whose call
        also scores the weight-sync probe, unless checked apart; its check is the
        `sync_check` phase). `on_rollout`: the rollout's training forward compares the
        weights, so the trainer scores no probe."""
        settings = self._settings(temperature, seed)
        if self.vllm is not None and not probe:  # pushed and checked by `_push_and_check`
            return self.vllm.sample(prompts, settings)[0]
        if self.vllm is not None:  # pushed by `_push_to_sampler`
            scored: list[torch.Tensor] = []  # the trainer's side, beside the sampling if it can
            beside = None
            if not on_rollout and self._check_beside():
                beside = lambda: scored.append(self._score_probe())  # noqa: E731
            rollout, scores = self.vllm.sample(prompts, settings, probe=self.probe, beside=beside)
            trainer = None if on_rollout else (scored[0] if scored else self._score_probe())
            self.weight_sync = self._check_sampler(scores, trainer)
            return rollout
        return self.torch_sampler.sample(prompts, settings)[0]

    def _push_to_sampler(self, step: int | None) -> None:
        """Push the rollout model's weights into vLLM (started on first use); its rollout
        then scores the weight-sync probe (engine/weight_sync.py)."""
        self.start()
        with self.clock.timed("sync"):
            self._unloaded = self.vllm.push(self.rollout_model, self.faults.push(step))

    def start(self) -> None:
        """Start the vLLM sampler the config names: colocated, or a server process (a no-op
        once started, and for the torch sampler)."""
        cfg = self.config
        if self.vllm is not None or cfg.rollout_backend not in VLLM_BACKENDS:
            return
        backend = sampler_class(cfg.rollout_backend)
        vocab = min(self.tokenizer.vocab_size, self.model.get_input_embeddings().num_embeddings)
        model, probe_tokens = self.rollout_model, cfg.weight_sync_probe_tokens
        if not self.node_server:
            self.vllm = backend(model, cfg, probe_tokens)
        else:  # local rank 0 starts (or reaches) the node's server; its peers reach it
            started: list = []

            def start_server() -> str:
                started.append(backend(model, cfg, probe_tokens))
                return started[0].client.url

            url = on_node_leader(self.parallel, start_server)
            failure = None
            if started:  # stopped by `close`, whatever the peers say
                self.vllm = started[0]
            else:
                try:
                    self.vllm = backend(model, cfg, probe_tokens, peer_of=url)  # a server's peer
                except SamplerError as exc:
                    failure = exc
            self._agree(failure)  # every rank reaches the server, or none goes on
            if failure is not None:
                raise failure
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

    def _check_beside(self) -> bool:
        """Whether the check's trainer forward may run while the sampler samples: when the
        trainer computes on a GPU, or the server grpod started has CPU cores of its own. On
        cores they share it may not: at W4 on 2 shared cores that forward took 2.0 s instead
        of 0.1 s beside the server, and the rollout slowed as much (bench/README.md)."""
        return self.device.type == "cuda" or bool(getattr(self.vllm, "own_cores", False))

    def _score_probe(self) -> torch.Tensor:
        """The trainer's logprobs of the probe's first `weight_sync_scored_tokens` tokens
        (what vLLM's prompt logprobs are compared with): the check's only trainer compute."""
        with self.clock.timed("sync_check"):
            return sequence_logprobs(
                self.rollout_model,
                self.probe[: self.config.weight_sync_scored_tokens],
                self.config.dtype,
                self.device,
            )

    def _check_sampler(self, scores: ProbeScores, trainer: torch.Tensor | None) -> WeightSyncCheck:
        """vLLM's logprobs of the probe (and its continuation) against the trainer's
        (`trainer`: its logprobs of the probe; None: the weights are compared on the rollout,
        the cache half alone here)."""
        with self.clock.timed("sync_check"):
            return compare(
                self.probe,
                scores,
                trainer,
                version=self.weight_version(),
                dtype=self.config.dtype,
                unloaded=self._unloaded,
            )


def on_node_leader(parallel: Parallel, work: Callable[[], Any]) -> Any:
    """`work()` on the node's local rank 0, its value on every rank of the node: a
    SamplerError or EngineError there is raised on every rank alike (the same kind: the exit
    code means the same on each), so no rank waits on a leader that has given up."""
    value, failure = None, None
    if parallel.node_leader:
        try:
            value = work()
        except (SamplerError, EngineError) as exc:
            failure = exc
    said = None if failure is None else (isinstance(failure, EngineError), str(failure))
    value, said = parallel.from_node_leader((value, said))
    if failure is not None:
        raise failure
    if said is not None:
        kind = EngineError if said[0] else SamplerError
        raise kind(f"{said[1]} (on local rank 0, which runs the node's rollout server)")
    return value
