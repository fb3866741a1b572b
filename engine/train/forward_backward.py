"""`ForwardBackward`: one step's trunk passes, chunked FP32 head + loss, and backward.

`run(batch, reference)` runs every trunk pass of the batch (engine/train/layout.py), each micro's
sequence chunks in the configured order, the valid-token counter over every chunk (zeroed
once, at the start), and one backward per pass; it returns what the pass measured
(`StepStats`: the per-chunk trace, loss sums, logprob and token statistics, the counter's
step total). The gradients it leaves are unscaled sums: the caller divides them by the
global valid-token count. `score(batch)` is the same head without gradients.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from grpod.engine.batch import TransportBatch
from grpod.engine.config import EngineConfig
from grpod.engine.faults import Faults
from grpod.engine.model.head import token_logprobs_entropy
from grpod.engine.model.parallel import Parallel
from grpod.engine.train.accounting import ValidTokenCounter
from grpod.engine.train.layout import TrunkLayout, micro_layout, run_trunk, trunk_passes
from grpod.engine.train.loss import LossSettings, policy_token_loss
from grpod.engine.train.stats import StepStats


class ForwardBackward:
    """The training pass over a model: `model` (FSDP-sharded or plain) and `train_trunk` (the
    module the training trunk runs through: DDP's wrapper, or the model itself)."""

    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        train_trunk: torch.nn.Module,
        parallel: Parallel,
        faults: Faults,
        device: torch.device,
    ) -> None:
        self.config, self.model, self.train_trunk = config, model, train_trunk
        self.parallel, self.faults, self.device = parallel, faults, device
        self.counter = ValidTokenCounter(per_chunk_reset=faults.per_micro_accounting)
        # the accounting fault runs chunks in reverse: the step then reads chunk 0 of the last micro
        reverse = config.chunk_order == "reverse" or faults.per_micro_accounting
        self.chunk_order = "reverse" if reverse else "forward"
        self.loss_settings = LossSettings.of(config)

    def run(self, batch: TransportBatch, reference: torch.Tensor | None) -> StepStats:
        """Forward + backward over every micro of `batch`; `reference`: the KL reference's
        logprobs `[micros, rows, seq]` (kl_beta > 0) or None."""
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
        stats.valid_tokens = self.counter.value
        return stats

    def _pass(
        self,
        batch: TransportBatch,
        micros: list[int],
        layout: TrunkLayout,
        reference: torch.Tensor | None,
        stats: StepStats,
    ) -> None:
        """One trunk forward over `micros`, their chunked losses, one backward."""
        shape = tuple(layout.input_ids.shape)
        with self.faults.trunk(self.model, batch, micros, layout.source, shape):
            hidden, source = run_trunk(self.train_trunk, layout, self.config.dtype, self.device)
        per_micro = source.numel() // len(micros)
        pass_loss = hidden.new_zeros((), dtype=torch.float32)
        for k, micro in enumerate(micros):
            micro_source = source[k * per_micro : (k + 1) * per_micro]
            micro_loss = self.chunk_losses(batch, micro, hidden, micro_source, reference, stats)
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

    def chunk_losses(
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
        bounds = chunk_bounds(mask.numel(), batch.sequence_chunks)
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
            chunk_loss = self.faults.token_loss(batch, micro, index, token_loss.loss).sum()
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
        # token p is scored by the logits at p-1; a shared prompt's last state is picked once
        # per completion. F.embedding, not hidden[...]: advanced indexing's backward adds such
        # repeats with atomic float adds on CPU at >1 thread (an order, a rounding, that vary
        # from run to run); embedding's adds them in index order at any thread count, on GPU too
        return token_logprobs_entropy(
            F.embedding(source[on_device - 1], hidden),
            head,
            targets[on_device],
            chunks=self.config.lmhead_chunks,
            temperature=self.config.temperature,
            entropy=entropy,
        )

    def _gather(self, tensor: torch.Tensor, micro: int, index: torch.Tensor) -> torch.Tensor:
        """Host tensor `[micros, rows, seq]` -> the micro's values at flat `index`, on device."""
        return tensor[micro].reshape(-1)[index].to(self.device, non_blocking=True)

    def trunk(
        self, model: torch.nn.Module, batch: TransportBatch, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk states `[positions run + 1, H]` (last row zeros) and `source: [rows * seq]`.

        The micro runs in its `trunk_layout`: each distinct prompt once, completions without
        their unread last token (engine/train/layout.py); `hidden[source[p]]` is micro position p.
        """
        return run_trunk(model, micro_layout(batch, [micro]), self.config.dtype, self.device)

    @torch.no_grad()
    def score(self, batch: TransportBatch, model: torch.nn.Module) -> torch.Tensor:
        """FP32 logprobs `[micros, rows, seq]` of every trainable token (0 elsewhere)."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        head = model.get_output_embeddings().weight
        for micro in range(batch.num_micros):
            hidden, source = self.trunk(model, batch, micro)
            targets = batch.input_ids[micro].reshape(-1).to(self.device)
            index = batch.loss_mask[micro].reshape(-1).nonzero().squeeze(-1)
            logprobs, _ = self._logprobs(hidden, source, head, targets, index)
            out[micro].view(-1)[index] = logprobs.cpu()
        return out


def chunk_bounds(length: int, chunks: int) -> list[int]:
    """Boundaries of `chunks` near-equal windows over `length` (as `tensor_split` cuts them)."""
    base, extra = divmod(length, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds
