"""The GRPO engine: rollout -> advantages -> pack -> accumulate -> apply | flush (`Engine`)."""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpod.engine import distcp
from grpod.engine.accounting import ValidTokenCounter
from grpod.engine.advantages import group_advantages
from grpod.engine.batch import TransportBatch
from grpod.engine.config import VLLM_BACKENDS, EngineConfig
from grpod.engine.cursor import DataCursor
from grpod.engine.errors import EngineError, RewardError, SamplerError
from grpod.engine.faults import Faults
from grpod.engine.flat import flatten_parameters
from grpod.engine.fused import unsupported as decoder_unsupported
from grpod.engine.inputs import use_reward_path
from grpod.engine.layout import (
    TrunkLayout,
    micro_layout,
    run_trunk,
    sequence_logprobs,
    trunk_passes,
)
from grpod.engine.lora import apply_lora, reference_mode
from grpod.engine.loss import LossSettings, policy_token_loss, token_logprobs_entropy
from grpod.engine.model import load_policy, resolve_device
from grpod.engine.packing import Sample, pack
from grpod.engine.parallel import Parallel, local, total_norm
from grpod.engine.prompts import cut_at_stop_strings, stop_token_ids, strip_stop_strings
from grpod.engine.report import StepReport
from grpod.engine.rewards import RewardSet
from grpod.engine.rollout import Rollout, sample
from grpod.engine.stats import StepStats
from grpod.engine.tasks import build_task
from grpod.engine.tokenizer import encode_prompt, require_chat_template
from grpod.engine.weight_sync import ProbeScores, WeightSyncCheck, compare, probe_sequence

if TYPE_CHECKING:  # imported on first use: vllm is an extra
    from grpod.engine.rollout_server import ServerSampler
    from grpod.engine.rollout_vllm import VLLMSampler

# the engine's phases, in step order: the weight push into a separate sampler (or the
# sharded run's rollout copy) and its check are their own phases, never part of "rollout"
PHASES = ("sync", "sync_check", "rollout", "score", "grad", "optim")


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
    `grpod.engine.step.decide_step(engine, policy, batch)`, which returns a `StepResult`.

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

    The machinery is one call away, each in its own module: sampling (rollout.py), packing
    (packing.py), the trunk layout (layout.py), the chunked FP32 head and loss (loss.py), the
    token counter (accounting.py), the drill fault hooks (faults.py).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel = Parallel.start(config)  # under torchrun: the process group, this rank
        if config.threads:
            torch.set_num_threads(config.threads)
        # drill hooks: identity unless [engine.faults] (and this rank is one of its ranks)
        self.faults = Faults(config.faults, self.parallel.rank)
        use_reward_path(config)  # the run's working directory, wherever this runs
        self.task = build_task(
            config.task,
            config.reward,
            config.long_prompt_batch_fraction,
            config.kv_retrieval_records,
            config.kv_retrieval_asked,
        )
        self.device = resolve_device(self.parallel.device(config.device))
        self.model, self.tokenizer = load_policy(config.model, self.task.chars, config.seq_len)
        self.kv_cache = config.kv_cache_spec
        if self.kv_cache is not None and decoder_unsupported(self.model) is not None:
            raise EngineError(
                f"model {config.model}: rollout_kv_cache {self.kv_cache.policy!r} needs the "
                f"fused decoder, which does not cover it ({decoder_unsupported(self.model)})"
            )
        # LoRA: adapters injected in place, base frozen; `adapters` is the PEFT handle
        self.adapters = (
            apply_lora(self.model, config.lora, config.seed) if config.lora.rank else None
        )
        self.model.to(self.device)
        require_chat_template(self.tokenizer, config.prompt_format)
        self.rewards = RewardSet(
            self.task, config.rewards, config.reward_weights, config.reward_timeout_seconds
        )
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.model)
        trained = copy.deepcopy(self.model) if self.parallel.sharded else self.model
        # one storage for every parameter: the guards' weights check is then one reduction
        self.flat_weights = flatten_parameters(self.model)
        self.reference = (  # with LoRA the reference is the base: the adapters disabled
            copy.deepcopy(self.model).requires_grad_(False)
            if config.kl_beta > 0 and self.adapters is None
            else None
        )
        # rollout and scoring run on this unsharded copy (engine/parallel.py): no collective
        self.rollout_model = self.model
        if self.parallel.sharded:
            self.model = self.parallel.shard(trained, config.dtype)
        # the module the training trunk runs through: DDP's wrapper, or the model itself
        self.train_trunk = (
            self.parallel.replicate(self.model, config.dtype)
            if self.parallel.replicated
            else self.model
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            # one kernel per parameter instead of ~10 ops each (CPU and CUDA have it)
            fused=self.device.type in ("cpu", "cuda") or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.counter = ValidTokenCounter(per_chunk_reset=self.faults.per_micro_accounting)
        # the accounting fault runs chunks in reverse: the step then reads chunk 0 of the last micro
        reverse = config.chunk_order == "reverse" or self.faults.per_micro_accounting
        self.chunk_order = "reverse" if reverse else "forward"
        self.loss_settings = LossSettings(
            kind=config.loss,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            logratio_clamp=config.logratio_clamp,
            tis_cap=config.tis_cap,
            kl_beta=config.kl_beta,
        )
        self.config_digest = config.digest()
        self.cursor = DataCursor()
        # vllm / vllm-server: built on first use (or by `start_sampler`)
        self.vllm: VLLMSampler | ServerSampler | None = None
        self.weight_sync: WeightSyncCheck | None = None  # the last push's check (vllm)
        self._probe: list[int] = []  # the weight-sync probe (engine/weight_sync.py)
        self._pending: StepReport | None = None
        self._phases: dict[str, float] = {}  # this step's phase seconds so far
        self._inner: list[float] = []  # seconds of phases timed inside the open ones

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

    # ----------------------------------------------------------------- the GRPO step
    def rollout(self) -> TransportBatch:
        """Sample this step's completions, score them, and pack the `TransportBatch`."""
        cfg, step, faults = self.config, self.step, self.faults
        generation = step // cfg.epochs
        cached = self.cursor.rollout_cache
        if cfg.epochs > 1 and cached is not None and cached.generation == generation:
            return replace(cached, step=step)  # same samples, same old logprobs: epoch > 1
        with self._timed("rollout"):
            prompts = self.task.prompts_for_step(generation, cfg.prompts_per_step, cfg.seed)
            prompts, first = self.parallel.local_groups(prompts)  # whole groups per rank
            prompt_ids = [self.encode_prompt(p.text) for p in prompts]
            try:
                out, completions, texts = self.generate(
                    [ids for ids in prompt_ids for _ in range(cfg.group_size)],
                    step_seed(cfg.seed, generation, self.parallel.rank),
                    step=step,
                )
            except SamplerError as exc:  # the prompts in flight, unsampled, for its incident
                exc.batch = self._unsampled(prompt_ids, first, generation)
                raise
            lengths = out.mask.sum(-1).tolist()
            failure: RewardError | None = None
            try:
                rewards, function_rewards = self.rewards.score(
                    prompts, texts, cfg.group_size, first * cfg.group_size
                )
            except RewardError as exc:  # the samples are packed unscored (NaN) for its incident
                rewards, function_rewards, failure = torch.full((len(texts),), math.nan), {}, exc
            rewards = faults.rewards(step, rewards, cfg.group_size)
            advantages, _ = group_advantages(
                rewards, cfg.group_size, cfg.scale_rewards, cfg.advantage_std
            )
            advantages = faults.advantages(step, advantages)
            sampler_logprobs = faults.sampler_logprobs(
                step, [row[:n] for row, n in zip(out.logprobs.tolist(), lengths)]
            )
            samples = [
                Sample(
                    tokens=prompt_ids[i // cfg.group_size] + ids,
                    prompt_len=len(prompt_ids[i // cfg.group_size]),
                    advantage=advantage,
                    sampler_logprobs=sampler_logprobs[i],
                    group=first + i // cfg.group_size,
                )
                for i, (ids, advantage) in enumerate(zip(completions, advantages.tolist()))
            ]
            batch = pack(
                samples,
                seq_len=cfg.seq_len,
                micro_batch_rows=cfg.micro_batch_rows,
                pack_rows=cfg.pack,
                pad_token_id=self.tokenizer.pad_token_id,
                rewards=rewards,
                step=step,
                config_digest=self.config_digest,
                sequence_chunks=cfg.sequence_chunks,
                generation=generation,
                injected_faults=faults.injected(step),
            )
            # the rollout's bounded cache travels with the batch: the trainer masks by it
            batch = replace(
                batch,
                kv_cache=self.kv_cache,
                kv_cache_stats=out.cache_stats,
                weight_version=self.weight_version,
                weight_sync=self.weight_sync if self.vllm is not None else None,
            )
            if function_rewards:
                batch = replace(batch, function_rewards=function_rewards)
            if self.parallel.distributed:
                batch = replace(batch, rank=self.parallel.rank, world_size=self.parallel.world_size)
            if failure is not None:
                failure.batch = batch
                raise failure
        if cfg.epochs > 1:  # one scoring pass per generation, reused by every epoch
            with self._timed("score"):
                batch = replace(batch, old_logprobs=self.score(batch))
            self.cursor.rollout_cache = batch
        return batch

    def accumulate(
        self, batch: TransportBatch, global_valid_tokens: int | None = None
    ) -> StepReport:
        """Forward + backward over every micro; grads scaled by the step's valid-token count
        (over every rank). `global_valid_tokens`: the recorded global count instead, for the
        replay of one rank's part of a distributed step in one process."""
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step}: accumulate before apply or flush")
        if self.loss_settings.tis_cap > 0 and batch.sampler_logprobs is None:
            raise EngineError(
                f"batch step {batch.step}: tis_cap is on but the batch has no sampler logprobs"
            )
        with self._timed("score"):
            reference = self._reference_logprobs(batch)  # kl_beta > 0
        with self._timed("grad"):
            stats = StepStats()
            self.counter.start_step()
            passes = list(trunk_passes(batch, joint=self.config.dtype == "float32"))
            # FSDP's collectives run per pass: every rank runs as many (a short one adds zeros);
            # DDP's one all-reduce runs at each rank's last pass
            extra_passes = 0
            if self.parallel.sharded:
                extra_passes = self.parallel.max_int(len(passes)) - len(passes)
            for i, (micros, layout) in enumerate(passes):
                with self._grad_sync(i == len(passes) - 1):
                    self._pass(batch, micros, layout, reference, stats)
            for _ in range(extra_passes):
                self._zero_pass(passes[0][1])
            valid_tokens = self.counter.value
            local_loss_sum = sum(float(x) for x in stats.micro_loss_sums)
            # the one collective of the count: every rank's [valid, expected, loss sum]
            ranks = self.parallel.gather(
                [valid_tokens, batch.expected_valid_tokens(), local_loss_sum]
            )
            if global_valid_tokens is None:
                global_valid_tokens = int(sum(r[0] for r in ranks))
            # the global step total, never one micro's (nor one rank's) count
            token_scale = 1.0 / max(global_valid_tokens, 1)
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, token_scale)
            self.faults.grads(batch.step, grads)
            grad_norm = self.parallel.worst(total_norm(grads))  # DDP: the worst replica's
        report = stats.report(
            batch,
            valid_tokens=valid_tokens,
            token_scale=token_scale,
            grad_norm=grad_norm,
            max_grad_norm=self.config.max_grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        report.rank, report.world_size = self.parallel.rank, self.parallel.world_size
        report.global_valid_tokens = global_valid_tokens
        report.rank_expected_valid_tokens = [int(r[1]) for r in ranks]
        report.local_loss = report.loss
        report.loss = sum(r[2] for r in ranks) * token_scale
        self._pending = report
        return report

    def apply(self) -> StepReport:
        """Clip with the pre-clip norm, take the AdamW step, advance the LR schedule."""
        report = self._take_pending()
        with self._timed("optim"):
            if report.clip_coef < 1.0:
                torch.nn.utils.clip_grads_with_norm_(
                    self.params,
                    self.config.max_grad_norm,
                    torch.tensor(report.grad_norm, device=self.device),
                )
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
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
        report = StepStats().report(
            batch,
            valid_tokens=0,
            token_scale=0.0,
            grad_norm=0.0,
            max_grad_norm=1.0,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        report.skipped_compute = True
        report.rank, report.world_size = self.parallel.rank, self.parallel.world_size
        report.micro_order = list(range(batch.num_micros))
        self.step = batch.step + 1
        return report

    # ----------------------------------------------------------------- machinery
    def _chunk_losses(
        self,
        batch: TransportBatch,
        micro: int,
        hidden: torch.Tensor,
        source: torch.Tensor,
        reference: torch.Tensor | None,
        stats: StepStats,
    ) -> torch.Tensor:
        """The micro's loss sum from trunk states: `hidden[source[p]]` is micro position p."""
        targets = batch.input_ids[micro].reshape(-1).to(self.device)
        mask = batch.loss_mask[micro].reshape(-1)  # [rows * seq], target-aligned
        token_index = mask.nonzero().squeeze(-1)  # trainable positions, sorted
        bounds = _chunk_bounds(mask.numel(), batch.sequence_chunks)
        cuts = torch.searchsorted(token_index, torch.tensor(bounds)).tolist()
        head = self.model.get_output_embeddings().weight
        chunks = range(batch.sequence_chunks)
        # the sampler is checked once per generation (its first epoch), against the old
        # logprobs the ratio uses: after an update the policy has moved on purpose
        first_epoch = batch.generation * self.config.epochs == batch.step
        if self.chunk_order == "reverse":
            chunks = reversed(chunks)
        micro_loss = hidden.new_zeros((), dtype=torch.float32)
        for c in chunks:
            self.counter.start_chunk()
            chunk_tokens = self.counter.add(mask[bounds[c] : bounds[c + 1]])
            index = token_index[cuts[c] : cuts[c + 1]]
            logprobs, entropy = self._logprobs(hidden, source, head, targets, index, entropy=True)
            old = logprobs.detach()
            if batch.old_logprobs is not None:
                old = self._gather(batch.old_logprobs, micro, index)
            sampler = None
            if batch.sampler_logprobs is not None:
                sampler = self._gather(batch.sampler_logprobs, micro, index)
            token_loss = policy_token_loss(
                logprobs,
                old,
                self._gather(batch.advantages, micro, index),
                self.loss_settings,
                sampler_logprobs=sampler,
                ref_logprobs=None if reference is None else self._gather(reference, micro, index),
            )
            chunk_loss = token_loss.loss.sum()
            micro_loss = micro_loss + chunk_loss
            stats.add_chunk(micro, c, chunk_tokens, chunk_loss, self.counter, token_loss)
            stats.add_logprobs(old, sampler if first_epoch else None, entropy)
        return micro_loss

    def _logprobs(
        self,
        hidden: torch.Tensor,
        source: torch.Tensor,
        head: torch.Tensor,
        targets: torch.Tensor,
        index: torch.Tensor,
        *,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FP32 logprobs `[len(index)]` of a micro's tokens at flat positions `index` (host),
        from trunk states `hidden[source[p]]` and the head weight; `targets: [rows * seq]`;
        and (`entropy`) the policy's detached per-token entropy from the same logits."""
        on_device = index.to(self.device)
        return token_logprobs_entropy(
            hidden[source[on_device - 1]],  # token p is scored by the logits at p-1
            head,
            targets[on_device],
            chunks=self.config.lmhead_chunks,
            temperature=self.config.temperature,
            entropy=entropy,
        )

    def _reference_logprobs(self, batch: TransportBatch) -> torch.Tensor | None:
        """The KL reference's logprobs: the frozen copy, or the base with adapters off."""
        if self.config.kl_beta == 0:
            return None
        if self.adapters is not None:
            with reference_mode(self.adapters):
                return self.score(batch)
        return self.score(batch, self.reference)

    def _pass(
        self,
        batch: TransportBatch,
        micros: list[int],
        layout: TrunkLayout,
        reference: torch.Tensor | None,
        stats: StepStats,
    ) -> None:
        """One trunk forward over `micros`, their chunked losses, one backward."""
        hidden, source = run_trunk(self.train_trunk, layout, self.config.dtype, self.device)
        per_micro = source.numel() // len(micros)
        pass_loss = hidden.new_zeros((), dtype=torch.float32)
        for k, micro in enumerate(micros):
            micro_source = source[k * per_micro : (k + 1) * per_micro]
            micro_loss = self._chunk_losses(batch, micro, hidden, micro_source, reference, stats)
            micro_loss = self.faults.micro_loss(batch.step, micro, micro_loss)
            stats.micro_loss_sums.append(micro_loss.detach())
            pass_loss = pass_loss + micro_loss
        pass_loss.backward()

    def _grad_sync(self, last: bool) -> AbstractContextManager:
        """DDP: gradients accumulate locally until the rank's last pass, which all-reduces."""
        if last or not self.parallel.replicated:
            return nullcontext()
        return self.train_trunk.no_sync()

    def _zero_pass(self, layout: TrunkLayout) -> None:
        """A forward + backward that adds exact zeros to every gradient the real passes touch:
        it keeps a rank with fewer trunk passes in step with FSDP's per-pass collectives."""
        hidden, _ = run_trunk(self.model, layout, self.config.dtype, self.device)
        head = self.model.get_output_embeddings().weight
        ((hidden[:1].float() @ head.float().T).sum() * 0.0).backward()

    def _gather(self, tensor: torch.Tensor, micro: int, index: torch.Tensor) -> torch.Tensor:
        """Host tensor `[micros, rows, seq]` -> the micro's values at flat `index`, on device."""
        return tensor[micro].reshape(-1)[index].to(self.device, non_blocking=True)

    def _trunk(
        self, model: torch.nn.Module, batch: TransportBatch, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk states `[positions run + 1, H]` (last row zeros) and `source: [rows * seq]`.

        The micro runs in its `trunk_layout`: each distinct prompt once, completions without
        their unread last token (engine/layout.py); `hidden[source[p]]` is micro position p.
        """
        return run_trunk(model, micro_layout(batch, [micro]), self.config.dtype, self.device)

    @torch.no_grad()
    def score(self, batch: TransportBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """FP32 logprobs `[micros, rows, seq]` of every trainable token (0 elsewhere)."""
        model = model or self.rollout_model  # unsharded: no collective per micro
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        head = model.get_output_embeddings().weight
        for micro in range(batch.num_micros):
            hidden, source = self._trunk(model, batch, micro)
            targets = batch.input_ids[micro].reshape(-1).to(self.device)
            index = batch.loss_mask[micro].reshape(-1).nonzero().squeeze(-1)
            logprobs, _ = self._logprobs(hidden, source, head, targets, index)
            out[micro].view(-1)[index] = logprobs.cpu()
        return out

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
            with self._timed("sync"):
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
            rollout, scores = self.vllm.sample(prompts, seed=seed, probe=self._probe, **settings)
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

    def _unsampled(self, prompt_ids: list[list[int]], first: int, generation: int):
        """The step's prompts packed without completions (NaN rewards and advantages): what
        a failed rollout server's incident keeps."""
        cfg = self.config
        samples = [
            Sample(
                tokens=ids,
                prompt_len=len(ids),
                advantage=math.nan,
                sampler_logprobs=[],
                group=first + g,
            )
            for g, ids in enumerate(prompt_ids)
            for _ in range(cfg.group_size)
        ]
        return pack(
            samples,
            seq_len=cfg.seq_len,
            micro_batch_rows=cfg.micro_batch_rows,
            pack_rows=cfg.pack,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=torch.full((len(samples),), math.nan),
            step=self.step,
            config_digest=self.config_digest,
            sequence_chunks=cfg.sequence_chunks,
            generation=generation,
            injected_faults=self.faults.injected(self.step),
        )

    def _push_to_sampler(self, step: int | None) -> None:
        """Push the rollout model's weights into vLLM (started on first use); its rollout
        then scores the weight-sync probe (engine/weight_sync.py)."""
        self.start_sampler()
        with self._timed("sync"):
            self.vllm.push(self.rollout_model, self.faults.push(step))

    def start_sampler(self) -> None:
        """Start the vLLM sampler the config names (a no-op once started, or for torch)."""
        cfg = self.config
        if self.vllm is not None or cfg.rollout_backend not in VLLM_BACKENDS:
            return
        if cfg.rollout_backend == "vllm-server":
            from grpod.engine.rollout_server import ServerSampler as Sampler
        else:
            from grpod.engine.rollout_vllm import VLLMSampler as Sampler
        vocab = min(self.tokenizer.vocab_size, self.model.get_input_embeddings().num_embeddings)
        self.vllm = Sampler(self.rollout_model, cfg, cfg.weight_sync_probe_tokens)
        self._probe = probe_sequence(self.vllm.probe_tokens, vocab)

    def close(self) -> None:
        """Stop what the engine started outside its process (a vLLM server)."""
        sampler, self.vllm = self.vllm, None
        if sampler is not None:
            sampler.close()

    def _check_sampler(self, scores: ProbeScores) -> WeightSyncCheck:
        """vLLM's logprobs of the probe (and its continuation) against the trainer's."""
        with self._timed("sync_check"):
            trainer = sequence_logprobs(
                self.rollout_model,
                self._probe + scores.continuation,
                self.config.dtype,
                self.device,
            )
            return compare(
                self._probe, scores, trainer, version=self.weight_version, dtype=self.config.dtype
            )

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as fed to the policy (`prompt_format`), as preflight checks them."""
        cfg = self.config
        return encode_prompt(
            self.tokenizer, text, f"task {self.task.name}", cfg.prompt_format, cfg.system_prompt
        )

    def take_phase_seconds(self) -> dict[str, float]:
        """Wall-clock seconds of the phases run since the last take: rollout, score, grad,
        optim (0 for a phase that did not run); the clock starts again from zero."""
        phases = {name: self._phases.get(name, 0.0) for name in PHASES}
        self._phases = {}
        return phases

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Time `phase`; a phase timed inside another is taken out of the outer one's
        seconds (the weight sync inside a rollout), so the phases add up to the step."""
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            inner = self._inner.pop()
            self._phases[phase] = self._phases.get(phase, 0.0) + spent - inner
            if self._inner:
                self._inner[-1] += spent

    def _take_pending(self) -> StepReport:
        if self._pending is None:
            raise EngineError("apply/flush without a pending accumulate")
        report, self._pending = self._pending, None
        self.step = report.step + 1
        return report

    def _lr_factor(self, applied: int) -> float:
        cfg = self.config
        if applied < cfg.warmup_steps:
            return (applied + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            progress = min(1.0, (applied - cfg.warmup_steps) / max(1, cfg.total_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    # ----------------------------------------------------------------- state
    DCP_KEYS = ("model", "optimizer")  # what a distributed engine saves through DCP (distcp.py)

    def state_dict(self, fqn: bool = False) -> dict[str, Any]:
        """Weights, AdamW state, LR schedule position and data cursor (plain tensors and dicts:
        `engine/checkpoint.py` or torch.distributed.checkpoint save it). Distributed (or
        `fqn`): model and optimizer in torch.distributed.checkpoint's form (`get_state_dict`)."""
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step} is still pending (apply or flush it)")
        if self.parallel.distributed or fqn:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optimizer = get_state_dict(self.model, self.optimizer)
        else:
            model = {name: p.detach() for name, p in self.trained_parameters()}
            optimizer = self.optimizer.state_dict()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "cursor": self.cursor.state_dict(),
        }

    def trained_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """What a checkpoint holds of the model: every trainable parameter (all of them, or
        with LoRA only the adapters: the frozen base is the model directory's)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; a state that does not fit this engine is an EngineError."""
        missing = sorted({"model", "optimizer", "scheduler", "cursor"} - set(state))
        if missing:
            raise EngineError(f"engine state: missing {', '.join(missing)}")
        if _fqn_form(state["optimizer"]):  # DCP's form: resharded onto this engine's layout
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
            self._load_rest(state)
            return
        params = dict(self.trained_parameters())
        weights = state["model"]
        if set(weights) != set(params):
            raise EngineError("weights do not match the model's parameters")
        for name, tensor in weights.items():
            if tensor.shape != params[name].shape:
                raise EngineError(
                    f"{name} has shape {tuple(tensor.shape)}, model has {tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_rest(state)

    def _load_rest(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None]})
        self.cursor.load_state_dict(state["cursor"])
        self.optimizer.zero_grad(set_to_none=True)

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write this engine's state (and JSON `extra`) to directory `path` atomically;
        distributed: collectively, with torch.distributed.checkpoint (engine/distcp.py)."""
        return distcp.save(path, {"engine": self}, self.parallel, extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore from directory `path`; returns the extra state saved with it."""
        return distcp.load(path, {"engine": self}, self.parallel)

    def state_digest(self) -> str:
        """sha256 over weights, optimizer state and the LR schedule position."""
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(_tensor_bytes(tensor))
        opt = self.optimizer.state_dict()
        for index in sorted(opt["state"]):
            for key, value in sorted(opt["state"][index].items()):
                h.update(f"{index}.{key}".encode())
                h.update(_tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode())
        h.update(f"schedule:{self.scheduler.last_epoch}".encode())
        return h.hexdigest()


def _fqn_form(optimizer: dict[str, Any]) -> bool:
    """An optimizer state dict keyed by parameter names (`get_state_dict`), not indices."""
    groups = optimizer.get("param_groups") or [{}]
    return any(isinstance(p, str) for p in groups[0].get("params", ()))


def _chunk_bounds(length: int, chunks: int) -> list[int]:
    """Boundaries of `chunks` near-equal windows over `length` (as `tensor_split` cuts them)."""
    base, extra = divmod(length, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    t = local(tensor.detach()).contiguous().cpu()  # a sharded model: this rank's shard
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """A per-step (per-rank) sampler seed: reproducible, independent of how many steps ran
    before; rank 0's is the one-process seed."""
    text = f"grpod:{seed}:{step}" + (f":{rank}" if rank else "")
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
