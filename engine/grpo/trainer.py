"""The GRPO engine: rollout -> advantages -> pack -> accumulate -> apply | flush (`Engine`)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.config import EngineConfig
from grpod.engine.context import ExecutionContext
from grpod.engine.data.inputs import use_reward_path
from grpod.engine.data.tokenizer import encode_prompt
from grpod.engine.errors import EngineError, SamplerError
from grpod.engine.faults import Faults
from grpod.engine.grpo.assemble import Assembler, StepInputs
from grpod.engine.grpo.build import build_parts
from grpod.engine.model.flat import storage_cover
from grpod.engine.model.lora import reference_mode
from grpod.engine.model.parallel import Parallel, total_norm
from grpod.engine.phases import PhaseClock
from grpod.engine.report import StepReport
from grpod.engine.rollout.ahead import Ahead, AheadStats
from grpod.engine.rollout.sampling import Pending, Sampling
from grpod.engine.state import distcp, engine_state
from grpod.engine.state.cursor import DataCursor
from grpod.engine.train.accounting import token_scale
from grpod.engine.train.forward_backward import ForwardBackward
from grpod.engine.train.optim import apply_update, build_optimizer, build_schedule
from grpod.engine.train.stats import StepTotals, build_report, skipped_report

if TYPE_CHECKING:
    from grpod.engine.rollout.sampler import Sampler
    from grpod.engine.weight_sync import WeightSyncCheck

__all__ = ["Engine", "step_seed"]


class Engine:
    """A GRPO policy in training: each optimizer step is rollout -> accumulate -> apply | flush.

    Example, on a CPU with the built-in tiny Qwen2 (a few seconds)::

        >>> from grpod.engine import Engine, EngineConfig
        >>> engine = Engine(EngineConfig(task="copy", prompts_per_step=2, group_size=4))
        >>> batch = engine.rollout()  # step 0's TransportBatch: 2 prompts x 4 completions
        >>> report = engine.accumulate(batch)  # StepReport, before anything is applied
        >>> report.valid_tokens == batch.expected_valid_tokens()
        True
        >>> report = engine.apply()  # or engine.flush(): the policy stays bit-identical
        >>> engine.step, engine.state_dict()["cursor"]["step"]
        (1, 1)

    Under the guards (the daemon, replay and the drills alike) a step is decided by
    `grpod.engine.grpo.step.decide_step(engine, policy, batch)`, which returns a `StepResult`.

    The step's contract:

    - `rollout()` samples step `self.step`: same config, seed and weights give the same batch,
      bit for bit (and the same blob digest). With `epochs > 1` a generation is sampled and
      scored once and reused by its epochs.
    - `accumulate(batch)` runs forward and backward over every micro. The valid-token count
      is accumulated over every micro and chunk and zeroed once per step; the gradients are
      scaled by that step total. Logits, logprobs, loss and gradients are FP32. It returns
      the `StepReport` (pre-clip grad norm included); exactly one of `apply()` / `flush()`
      follows.
    - `apply()` clips with the reported norm, takes the AdamW step and advances the schedule;
      `flush()` discards the gradients: weights, optimizer state and schedule position stay
      bit-identical. `skip(batch)` flushes a step without computing it. All three advance
      the data cursor.
    - `take_phase_seconds()` gives the wall-clock seconds of the step's phases;
      `state_dict()` / `load_state_dict()` (torch.distributed.checkpoint's `Stateful`) carry
      the weights, AdamW state, schedule position and data cursor.

    The machinery is one call away, each in its own module: construction (build.py),
    sampling and the weight sync (sampling.py over the torch sampler, torch_sampler.py, or vLLM),
    samples sampled ahead (ahead.py), rewards, advantages and packing (assemble.py over
    packing.py), the forward/backward pass and chunk loop (forward_backward.py over
    layout.py's trunk and loss.py's FP32 head and loss), the token counter and the step's
    divisor (accounting.py), the report (stats.py), the optimizer and schedule (optim.py),
    state and digest (state/engine_state.py), the phase clock (phases.py), the drill fault hooks
    (faults.py).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel = Parallel.start(config)  # under torchrun: the process group, this rank
        if config.threads:
            torch.set_num_threads(config.threads)
        # drill hooks: identity unless [engine.faults] (and this rank is one of its ranks)
        self.faults = Faults(config.faults, self.parallel.rank)
        use_reward_path(config)  # the run's working directory, wherever this runs
        parts = build_parts(config, self.parallel)  # engine/grpo/build.py
        self.task, self.rewards, self.device = parts.task, parts.rewards, parts.device
        self.model, self.tokenizer, self.adapters = parts.model, parts.tokenizer, parts.adapters
        self.rollout_model, self.reference = parts.rollout_model, parts.reference
        self.params = parts.params
        self.kv_cache, self.stop_token_ids = parts.kv_cache, parts.stop_token_ids
        # what decides the step's floats, held for every accumulate (engine/context.py)
        self.context = ExecutionContext.capture(self.device)
        self.optimizer = build_optimizer(self.params, config, self.device)
        self.scheduler = build_schedule(self.optimizer, config)
        self.forward_backward = ForwardBackward(
            config, self.model, parts.train_trunk, self.parallel, self.faults, self.device
        )
        self.clock = PhaseClock()
        self.sampling = Sampling(
            config, parts, self.parallel, self.faults, self.clock, lambda: self.weight_version
        )
        self.assembler = Assembler(
            config,
            self.rewards,
            self.faults,
            self.parallel,
            self.tokenizer.pad_token_id,
            self.kv_cache,
        )
        self.cursor = DataCursor()
        self._pending: StepReport | None = None
        # max_staleness > 0: the rollouts of the next steps, sampled ahead (engine/rollout/ahead.py)
        self.ahead = (
            Ahead(
                config.max_staleness,
                self._launch,
                lambda: self.weight_version,
                self.faults.early_rollout,
            )
            if config.max_staleness
            else None
        )

    @property
    def step(self) -> int:
        """The next step to roll out (the data cursor's)."""
        return self.cursor.step

    @step.setter
    def step(self, value: int) -> None:
        self.cursor.step = value

    @property
    def weight_version(self) -> int:
        """The policy's weight version: the updates applied to it (restored by a checkpoint)."""
        return int(self.scheduler.last_epoch)

    @property
    def per_micro_accounting(self) -> bool:
        """Whether the valid-token counter is per micro (the drill's accounting fault) rather
        than step-accumulated; the reorder guard is on for such an engine."""
        return self.faults.per_micro_accounting

    @property
    def vllm(self) -> Sampler | None:
        """The vLLM sampler (rollout_backend vllm / vllm-server; started by the first
        rollout, or `start_sampler`): a `Sampler` that holds its own copy of the weights."""
        return self.sampling.vllm

    @property
    def flat_weights(self) -> torch.Tensor | None:
        """A 1-D tensor over the one storage the rollout model's parameters share (engine/model/
        flat.py), where it is now: grpod's own vLLM server moves it into shared memory."""
        return storage_cover(list(self.rollout_model.parameters()))

    @property
    def weight_sync(self) -> WeightSyncCheck | None:
        """The last weight push's check (vLLM), or None."""
        return self.sampling.weight_sync

    # ----------------------------------------------------------------- the GRPO step
    def rollout(self) -> TransportBatch:
        """Sample this step's completions, score them, and pack the `TransportBatch`."""
        cfg, step = self.config, self.step
        generation = step // cfg.epochs
        cached = self.cursor.rollout_cache
        if cfg.epochs > 1 and cached is not None and cached.generation == generation:
            return replace(cached, step=step)  # same samples, same old logprobs: epoch > 1
        with self.clock.timed("rollout"):
            try:
                if self.ahead is None:  # on-policy: sampled now, with the weights it trains
                    pending, staleness = self._launch(step), None
                else:
                    pending, staleness = self.ahead.take(step)
                out, completions, texts = self.sampling.finish(pending.result())
            except SamplerError as exc:  # the prompts in flight, unsampled, for its incident
                exc.batch = self.assembler.unsampled(
                    step, self._step_prompts(step), self.weight_version
                )
                raise
            batch = self.assembler.batch(  # rewards, group advantages, packing: assemble.py
                step,
                pending.inputs,
                out,
                completions,
                texts,
                version=pending.version,
                weight_sync=pending.weight_sync,
                staleness=staleness,
            )
        if cfg.epochs > 1:  # one scoring pass per generation, reused by every epoch
            with self.clock.timed("score"):
                batch = replace(batch, old_logprobs=self.score(batch))
            self.cursor.rollout_cache = batch
        return batch

    def take_ahead_stats(self) -> AheadStats | None:
        """max_staleness > 0: the rollout seconds overlapped with training and the rollouts
        dropped since the last take (engine/rollout/ahead.py); None for on-policy steps."""
        return None if self.ahead is None else self.ahead.take_stats()

    def set_horizon(self, steps: int | None) -> None:
        """No rollout is sampled ahead for a step at or past `steps` (the run's max_steps)."""
        if self.ahead is not None:
            self.ahead.horizon = steps or None

    def _step_prompts(self, step: int) -> StepInputs:
        """Step `step`'s prompts (this rank's whole groups), the first group's index, ids."""
        cfg = self.config
        prompts = self.task.prompts_for_step(step // cfg.epochs, cfg.prompts_per_step, cfg.seed)
        prompts, first = self.parallel.local_groups(prompts)  # whole groups per rank
        return prompts, first, [self.encode_prompt(p.text) for p in prompts]

    def _launch(self, step: int) -> Pending:
        """Step `step`'s rollout at the policy's weights now (rollout/sampling.py `submit`)."""
        cfg = self.config
        prompts, first, prompt_ids = self._step_prompts(step)
        pending = self.sampling.submit(
            [ids for ids in prompt_ids for _ in range(cfg.group_size)],
            step_seed(cfg.seed, step // cfg.epochs, self.parallel.rank),
            step=step,
        )
        pending.inputs = (prompts, first, prompt_ids)
        return pending

    def accumulate(
        self, batch: TransportBatch, global_valid_tokens: int | None = None
    ) -> StepReport:
        """Forward + backward over every micro; grads scaled by the step's valid-token count
        (over every rank). `global_valid_tokens`: the recorded global count instead, for the
        replay of one rank's part of a distributed step in one process."""
        self._check_accumulate(batch)
        self.context.apply()  # a colocated vLLM's worker may have changed the threads
        with self.clock.timed("score"):
            reference = self._reference_logprobs(batch)  # kl_beta > 0
        with self.clock.timed("grad"):
            stats = self.forward_backward.run(batch, reference)  # unscaled gradient sums
            # the one collective of the count: every rank's [valid, expected, loss sum]
            ranks = self.parallel.gather(
                [stats.valid_tokens, batch.expected_valid_tokens(), stats.loss_sum]
            )
            if global_valid_tokens is None:
                global_valid_tokens = int(sum(r[0] for r in ranks))
            scale = token_scale(global_valid_tokens)  # the step total: never a micro's count
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, scale)
            self.faults.grads(batch.step, grads)
            grad_norm = self.parallel.worst(total_norm(grads))  # DDP: the worst replica's
        totals = StepTotals(
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
            ranks=ranks,
            global_valid_tokens=global_valid_tokens,
            token_scale=scale,
            grad_norm=grad_norm,
            max_grad_norm=self.config.max_grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        self._pending = build_report(batch, stats, totals)
        return self._pending

    def apply(self) -> StepReport:
        """Clip with the pre-clip norm, take the AdamW step, advance the LR schedule."""
        report = self._take_pending()
        with self.clock.timed("optim"):
            apply_update(
                self.params,
                self.optimizer,
                self.scheduler,
                grad_norm=report.grad_norm,
                max_grad_norm=self.config.max_grad_norm,
                clip_coef=report.clip_coef,
                device=self.device,
            )
        return report

    def flush(self) -> StepReport:
        """Discard the step's gradients: weights, optimizer state and schedule untouched."""
        report = self._take_pending()
        self.optimizer.zero_grad(set_to_none=True)
        return report

    def skip(self, batch: TransportBatch) -> StepReport:
        """Flush a step without computing it (a guard's skip-fast); the cursor advances."""
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step}: skip before apply or flush")
        self.step = batch.step + 1
        return skipped_report(
            batch,
            rank=self.parallel.rank,
            world_size=self.parallel.world_size,
            lr=self.optimizer.param_groups[0]["lr"],
        )

    # ----------------------------------------------------------------- one call away
    def start_sampler(self) -> None:
        """Start the vLLM sampler the config names now (else the first rollout does)."""
        self.sampling.start()

    def close(self) -> None:
        """Stop what the engine started outside its process (a vLLM server)."""
        self.sampling.close()

    def score(self, batch: TransportBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """FP32 logprobs `[micros, rows, seq]` of every trainable token (0 elsewhere), by the
        unsharded rollout copy (no collective per micro) unless `model` is given."""
        return self.forward_backward.score(batch, model or self.rollout_model)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as fed to the policy (`prompt_format`), as preflight checks them."""
        cfg = self.config
        return encode_prompt(
            self.tokenizer, text, f"task {self.task.name}", cfg.prompt_format, cfg.system_prompt
        )

    def take_phase_seconds(self) -> dict[str, float]:
        """Wall-clock seconds of the phases run since the last take: sync, sync_check,
        rollout, score, grad, optim (0 for a phase that did not run); the clock restarts."""
        return self.clock.take()

    def _check_accumulate(self, batch: TransportBatch) -> None:
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step}: accumulate before apply or flush")
        if self.forward_backward.loss_settings.tis_cap > 0 and batch.sampler_logprobs is None:
            raise EngineError(
                f"batch step {batch.step}: tis_cap is on but the batch has no sampler logprobs"
            )

    def _reference_logprobs(self, batch: TransportBatch) -> torch.Tensor | None:
        """The KL reference's logprobs: the frozen copy, or the base with adapters off."""
        if self.config.kl_beta == 0:
            return None
        if self.adapters is not None:
            with reference_mode(self.adapters):
                return self.score(batch)
        return self.score(batch, self.reference)

    def _take_pending(self) -> StepReport:
        if self._pending is None:
            raise EngineError("apply/flush without a pending accumulate")
        report, self._pending = self._pending, None
        self.step = report.step + 1
        return report

    # --------------------------------------------------------- state (engine/state/engine_state.py)
    DCP_KEYS = ("model", "optimizer")  # what a distributed engine saves through DCP (distcp.py)

    def state_dict(self, fqn: bool = False) -> dict[str, Any]:
        """Weights, AdamW state, LR schedule position and data cursor (plain tensors and dicts:
        `engine/state/checkpoint.py` or torch.distributed.checkpoint save it). Distributed (or
        `fqn`): model and optimizer in torch.distributed.checkpoint's form (`get_state_dict`)."""
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step} is still pending (apply or flush it)")
        fqn = fqn or self.parallel.distributed
        return engine_state.state_dict(
            self.model, self.optimizer, self.scheduler, self.cursor, fqn=fqn
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()`; a state that does not fit this engine is an EngineError."""
        engine_state.load_state_dict(
            state_dict, self.model, self.optimizer, self.scheduler, self.cursor
        )
        if self.ahead is not None:  # sampled from weights this state replaces
            self.ahead.clear()

    def trained_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """What a checkpoint holds of the model: every trainable parameter (all of them, or
        with LoRA only the adapters: the frozen base is the model directory's)."""
        return engine_state.trained_parameters(self.model)

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write this engine's state (and JSON `extra`) to directory `path` atomically;
        distributed: collectively, with torch.distributed.checkpoint (engine/state/distcp.py)."""
        return distcp.save(path, {"engine": self}, self.parallel, extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore from directory `path`; returns the extra state saved with it."""
        return distcp.load(path, {"engine": self}, self.parallel)

    def state_digest(self) -> str:
        """sha256 over weights, optimizer state and the LR schedule position."""
        return engine_state.state_digest(self.model, self.optimizer, self.scheduler)


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """A per-step (per-rank) sampler seed: reproducible, independent of how many steps ran
    before; rank 0's is the one-process seed."""
    text = f"grpod:{seed}:{step}" + (f":{rank}" if rank else "")
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
