"""The GRPO engine: rollout -> advantages -> pack -> accumulate -> apply | flush.

`Engine.rollout()` produces the step's `TransportBatch`; `accumulate(batch)` runs forward and
backward over every micro and returns the `StepReport` (grad norm included) before anything is
applied; the caller then decides: `apply()` or `flush()`. The machinery (sampling, packing,
the chunked FP32 head, the token counter) is one call away, each in its own module.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from grpod.engine.accounting import ValidTokenCounter
from grpod.engine.advantages import group_advantages
from grpod.engine.batch import TransportBatch
from grpod.engine.checkpoint import load_checkpoint, save_checkpoint
from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError
from grpod.engine.flat import flatten_parameters
from grpod.engine.loss import LossSettings, policy_token_loss, token_logprobs
from grpod.engine.model import compute_context, load_policy, resolve_device
from grpod.engine.packing import Sample, TrunkLayout, joint_slots, pack, scan_units, trunk_layout
from grpod.engine.report import StepReport
from grpod.engine.rollout import Rollout, sample
from grpod.engine.stats import StepStats
from grpod.engine.tasks import build_task
from grpod.engine.trunk import trunk_states
from grpod.engine.trunk import unsupported as trunk_unsupported

SENTINEL_LOGPROB = -9999.0
LOSS_SPIKE_SCALE = 1000.0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.faults_on:
            warnings.warn(
                "grpod engine: FAULT INJECTION IS ON (drill mode); this run corrupts steps "
                "on purpose",
                stacklevel=2,
            )
        self.task = build_task(config.task, config.reward, config.long_prompt_batch_fraction)
        self.device = resolve_device(config.device)
        self.model, self.tokenizer = load_policy(config.model, self.task.chars, config.seq_len)
        self.model.to(self.device)
        # one storage for every parameter: the guards' weights check is then one reduction
        self.flat_weights = flatten_parameters(self.model)
        self.reference = (
            copy.deepcopy(self.model).requires_grad_(False) if config.kl_beta > 0 else None
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
        self.counter = ValidTokenCounter(per_chunk_reset=config.accounting_fault != "none")
        self.loss_settings = LossSettings(
            kind=config.loss,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            logratio_clamp=config.logratio_clamp,
            tis_cap=config.tis_cap,
            kl_beta=config.kl_beta,
        )
        self.config_digest = config.digest()
        self.step = 0  # the next batch to roll out (the data cursor)
        self.vllm = None  # built on first use: rollout_backend = "vllm" (GPU nodes)
        self.rollout_cache: TransportBatch | None = None  # epochs > 1: this generation's batch
        self._pending: StepReport | None = None

    # ----------------------------------------------------------------- the GRPO step
    def rollout(self) -> TransportBatch:
        """Sample this step's completions, score them, and pack the `TransportBatch`."""
        cfg, step = self.config, self.step
        generation = step // cfg.epochs
        cached = self.rollout_cache
        if cfg.epochs > 1 and cached is not None and cached.meta["generation"] == generation:
            return replace(cached, step=step)  # same samples, same old logprobs: epoch > 1
        started = time.perf_counter()
        prompts = self.task.prompts_for_step(generation, cfg.prompts_per_step, cfg.seed)
        prompt_ids = [self._encode_prompt(p.text) for p in prompts]
        out = self._sample(
            [ids for ids in prompt_ids for _ in range(cfg.group_size)],
            step_seed(cfg.seed, generation),
        )
        lengths = out.mask.sum(-1).tolist()
        completions = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        rewards = torch.tensor(
            [
                self.task.score(prompts[i // cfg.group_size], self.tokenizer.decode(ids), i)
                for i, ids in enumerate(completions)
            ],
            dtype=torch.float32,
        )
        injected = []
        if step in cfg.fault_equal_reward_steps:
            rewards = rewards.reshape(-1, cfg.group_size)[:, :1].expand(-1, cfg.group_size)
            rewards = rewards.reshape(-1).clone()
            injected.append("equal-rewards")
        advantages, _ = group_advantages(
            rewards, cfg.group_size, cfg.scale_rewards, cfg.advantage_std
        )
        if step in cfg.fault_loss_spike_steps:
            advantages = advantages * LOSS_SPIKE_SCALE
            injected.append("loss-spike")
        sampler_logprobs = out.logprobs.tolist()
        samples = [
            Sample(
                tokens=prompt_ids[i // cfg.group_size] + ids,
                prompt_len=len(prompt_ids[i // cfg.group_size]),
                advantage=advantage,
                sampler_logprobs=sampler_logprobs[i][: len(ids)],
                group=i // cfg.group_size,
            )
            for i, (ids, advantage) in enumerate(zip(completions, advantages.tolist()))
        ]
        if step in cfg.fault_sentinel_logprob_steps:
            first = next(i for i, n in enumerate(lengths) if n > 0)
            samples[first].sampler_logprobs[0] = SENTINEL_LOGPROB
            injected.append("sentinel-logprob")
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
            meta={"generation": generation, "injected": injected},
        )
        rollout_seconds = time.perf_counter() - started
        score_seconds = 0.0
        if cfg.epochs > 1:  # one scoring pass per generation, reused by every epoch
            started = time.perf_counter()
            batch = replace(batch, old_logprobs=self.score(batch))
            score_seconds = time.perf_counter() - started
            self.rollout_cache = batch
        batch.meta.update(rollout_seconds=rollout_seconds, score_seconds=score_seconds)
        return batch

    def accumulate(self, batch: TransportBatch) -> StepReport:
        """Forward + backward over every micro; grads scaled by the step's valid-token count."""
        if self._pending is not None:
            raise EngineError(f"step {self._pending.step}: accumulate before apply or flush")
        if self.loss_settings.tis_cap > 0 and batch.sampler_logprobs is None:
            raise EngineError(
                f"batch step {batch.step}: tis_cap is on but the batch has no sampler logprobs"
            )
        started = time.perf_counter()
        reference = self.score(batch, self.reference) if self.reference is not None else None
        score_seconds = batch.meta.get("score_seconds", 0.0) + time.perf_counter() - started

        started = time.perf_counter()
        stats = StepStats()
        self.counter.start_step()
        for micros, layout in self._trunk_passes(batch):
            hidden, source = self._run_trunk(self.model, layout)
            per_micro = source.numel() // len(micros)
            pass_loss = hidden.new_zeros((), dtype=torch.float32)
            for k, micro in enumerate(micros):
                micro_source = source[k * per_micro : (k + 1) * per_micro]
                micro_loss = self._chunk_losses(
                    batch, micro, hidden, micro_source, reference, stats
                )
                if batch.step in self.config.fault_nan_loss_steps and micro == 0:
                    micro_loss = micro_loss * float("nan")  # poisons the gradients, as in the wild
                stats.micro_loss_sums.append(micro_loss.detach())
                pass_loss = pass_loss + micro_loss
            pass_loss.backward()
        valid_tokens = self.counter.value
        token_scale = 1.0 / max(valid_tokens, 1)  # the step total, never one micro's count
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, token_scale)
        if batch.step in self.config.fault_inf_grad_steps:
            grads[0].view(-1)[0] = float("inf")
        grad_norm = float(torch.nn.utils.get_total_norm(grads))
        grad_seconds = time.perf_counter() - started

        report = stats.report(
            batch,
            valid_tokens=valid_tokens,
            token_scale=token_scale,
            grad_norm=grad_norm,
            max_grad_norm=self.config.max_grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        report.phase_seconds = {
            "rollout": batch.meta.get("rollout_seconds", 0.0),
            "score": score_seconds,
            "grad": grad_seconds,
            "optim": 0.0,
        }
        self._pending = report
        return report

    def apply(self) -> StepReport:
        """Clip with the pre-clip norm, take the AdamW step, advance the LR schedule."""
        report = self._take_pending()
        started = time.perf_counter()
        if report.clip_coef < 1.0:
            torch.nn.utils.clip_grads_with_norm_(
                self.params,
                self.config.max_grad_norm,
                torch.tensor(report.grad_norm, device=self.device),
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        report.phase_seconds["optim"] = time.perf_counter() - started
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
        if self.config.chunk_order == "reverse" or self.config.accounting_fault != "none":
            chunks = reversed(chunks)
        micro_loss = hidden.new_zeros((), dtype=torch.float32)
        for c in chunks:
            self.counter.start_chunk()
            chunk_tokens = self.counter.add(mask[bounds[c] : bounds[c + 1]])
            index = token_index[cuts[c] : cuts[c + 1]]
            on_device = index.to(self.device)
            logprobs = token_logprobs(
                hidden[source[on_device - 1]],  # token p is scored by the logits at p-1
                head,
                targets[on_device],
                chunks=self.config.lmhead_chunks,
                temperature=self.config.temperature,
            )
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
            stats.add_logprobs(logprobs.detach(), sampler)
        return micro_loss

    def _gather(self, tensor: torch.Tensor, micro: int, index: torch.Tensor) -> torch.Tensor:
        """Host tensor `[micros, rows, seq]` -> the micro's values at flat `index`, on device."""
        return tensor[micro].reshape(-1)[index].to(self.device, non_blocking=True)

    def _trunk(
        self, model: torch.nn.Module, batch: TransportBatch, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk states `[positions run + 1, H]` (last row zeros) and `source: [rows * seq]`.

        The micro runs in its `trunk_layout`: each distinct prompt once, completions without
        their unread last token (engine/packing.py); `hidden[source[p]]` is micro position p.
        """
        return self._run_trunk(model, _layout(batch, [micro]))

    def _trunk_passes(self, batch: TransportBatch) -> Iterator[tuple[list[int], TrunkLayout]]:
        """Consecutive micros whose joint trunk layout fits one micro's `rows * seq` slots.

        Shared prompts and dropped tails shrink a micro's trunk work, so several micros often
        fit the activation budget of one; they then run as one forward and one backward (the
        loss, counter and trace stay per micro and per chunk, in order). FP32 only: under
        bf16 autocast a joint backward would sum the micros' weight gradients inside a bf16
        matmul, so there each micro runs alone and accumulates into the FP32 grads.
        """
        if self.config.dtype != "float32":
            for micro in range(batch.num_micros):
                yield [micro], _layout(batch, [micro])
            return
        seq = batch.seq_len
        budget = batch.input_ids.shape[1] * seq
        everything = list(range(batch.num_micros))
        layout = _layout(batch, everything)
        if layout.input_ids.numel() <= budget:  # the common case: one pass, one layout
            yield everything, layout
            return
        # each micro scanned once; a candidate group's size comes from its scans, and only
        # the groups that run are laid out
        scans = [
            scan_units(
                batch.input_ids[m], batch.position_ids[m], batch.sample_ids[m], batch.loss_mask[m]
            )
            for m in everything
        ]
        micros: list[int] = []
        for micro in everything:
            if micros and joint_slots(scans[micros[0] : micro + 1], seq) > budget:
                yield micros, _layout(batch, micros)
                micros = []
            micros.append(micro)
        if micros:
            yield micros, _layout(batch, micros)

    def _run_trunk(
        self, model: torch.nn.Module, layout: TrunkLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk states `[positions run + 1, H]` (last row zeros) and the layout's source.

        Qwen2 / Llama in FP32 run `engine.trunk.trunk_states` (bit-identical to the Hugging
        Face forward, without its plumbing); anything else the Hugging Face forward.
        """
        input_ids = layout.input_ids.to(self.device)
        position_ids = layout.position_ids.to(self.device)
        mask = layout.attention_mask.to(self.device)
        with compute_context(self.config.dtype, self.device):
            if trunk_unsupported(model, self.config.dtype) is None:
                hidden = trunk_states(model, input_ids, position_ids, mask)
            else:
                hidden = model.base_model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=mask,
                    use_cache=False,
                ).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])
        return hidden, layout.source.to(self.device)

    @torch.no_grad()
    def score(self, batch: TransportBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """FP32 logprobs `[micros, rows, seq]` of every trainable token (0 elsewhere)."""
        model = model or self.model
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        head = model.get_output_embeddings().weight
        for micro in range(batch.num_micros):
            hidden, source = self._trunk(model, batch, micro)
            targets = batch.input_ids[micro].reshape(-1).to(self.device)
            index = batch.loss_mask[micro].reshape(-1).nonzero().squeeze(-1)
            on_device = index.to(self.device)
            logprobs = token_logprobs(
                hidden[source[on_device - 1]],
                head,
                targets[on_device],
                chunks=self.config.lmhead_chunks,
                temperature=self.config.temperature,
            )
            out[micro].view(-1)[index] = logprobs.cpu()
        return out

    def _sample(self, prompts: list[list[int]], seed: int) -> Rollout:
        """Completions from the configured backend: the torch sampler, or vLLM on GPU nodes."""
        cfg = self.config
        settings = dict(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if cfg.rollout_backend == "vllm":
            if self.vllm is None:
                from grpod.engine.rollout_vllm import VLLMSampler

                self.vllm = VLLMSampler(self.model, cfg)
            self.vllm.sync(self.model)
            return self.vllm.sample(prompts, seed=seed, **settings)
        generator = torch.Generator(self.device).manual_seed(seed)
        return sample(
            self.model,
            prompts,
            generator=generator,
            dtype=cfg.dtype,
            decoder=cfg.rollout_decoder,
            **settings,
        )

    def _encode_prompt(self, text: str) -> list[int]:
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as exc:
            raise EngineError(f"task {self.task.name}: prompt {text[:40]!r}: {exc}") from None
        bos = self.tokenizer.bos_token_id
        return ids if bos is None else [bos, *ids]

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

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write the full training state to directory `path` atomically (see checkpoint.py)."""
        return save_checkpoint(self, path, extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore from directory `path`; returns the extra state saved with it."""
        return load_checkpoint(self, path)

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


def _layout(batch: TransportBatch, micros: list[int]) -> TrunkLayout:
    """The joint trunk layout of consecutive `micros` (their rows stacked)."""
    span = slice(micros[0], micros[-1] + 1)
    seq = batch.seq_len
    return trunk_layout(
        batch.input_ids[span].reshape(-1, seq),
        batch.position_ids[span].reshape(-1, seq),
        batch.sample_ids[span].reshape(-1, seq),
        batch.loss_mask[span].reshape(-1, seq),
    )


def _chunk_bounds(length: int, chunks: int) -> list[int]:
    """Boundaries of `chunks` near-equal windows over `length` (as `tensor_split` cuts them)."""
    base, extra = divmod(length, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def step_seed(seed: int, step: int) -> int:
    """A per-step sampler seed: reproducible, independent of how many steps ran before."""
    digest = hashlib.sha256(f"grpod:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
