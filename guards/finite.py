"""`finite`: non-finite numbers and sentinel logprobs never reach the optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard
from grpod.guards.verdict import Action, Finding


class FiniteGuard(Guard):
    """FLUSH on a non-finite loss, micro loss or grad norm; on a non-finite reward, or a
    non-finite advantage / sampler logprob / old logprob of a trainable token; on sentinel
    sampler logprobs (<= `sentinel_logprob_max`) of trainable tokens. HALT (`weights_action`)
    when the weights are non-finite after an apply."""

    name = "finite"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        if self._clean(batch, report):
            return []
        return self._findings(batch, report)

    def _clean(self, batch: TransportBatch, report: StepReport) -> bool:
        """A cheap exact test that `_findings` would find nothing: one min/max pass per tensor
        (NaN propagates through aminmax). False only means "look closer"."""
        if not (
            math.isfinite(report.loss)
            and math.isfinite(report.grad_norm)
            and all(math.isfinite(x) for x in report.micro_losses)
        ):
            return False
        tensors = [batch.rewards, batch.advantages, batch.old_logprobs]  # whole: no mask needed
        for tensor in tensors:
            if tensor is not None and tensor.numel() and not _finite_range(tensor):
                return False
        sampler = batch.sampler_logprobs
        if sampler is None or not sampler.numel():
            return True
        # trainable tokens only (the others read 0): finite, and none at or below the limit
        lowest, highest = torch.aminmax(torch.where(batch.loss_mask, sampler, 0.0))
        lowest, highest = float(lowest), float(highest)
        return math.isfinite(highest) and lowest > self.config.sentinel_logprob_max

    def _findings(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        findings: list[Finding] = []
        if not math.isfinite(report.loss):
            findings.append(self.finding(f"loss is {report.loss}", loss=report.loss))
        bad = [i for i, x in enumerate(report.micro_losses) if not math.isfinite(x)]
        if bad:
            findings.append(
                self.finding(
                    f"{len(bad)} micro losses are non-finite (first: micro {bad[0]})",
                    nonfinite_micros=float(len(bad)),
                    first_micro=float(bad[0]),
                )
            )
        if not math.isfinite(report.grad_norm):
            findings.append(
                self.finding(f"grad norm is {report.grad_norm}", grad_norm=report.grad_norm)
            )
        bad_rewards = (~torch.isfinite(batch.rewards)).nonzero().flatten().tolist()
        if bad_rewards:  # first: a NaN reward makes the loss NaN, and the cause is the reward
            first = bad_rewards[0]
            value = float(batch.rewards[first])
            findings.insert(
                0,
                self.finding(
                    f"{len(bad_rewards)} rewards are non-finite (first: sample {first}, {value})",
                    nonfinite_rewards=float(len(bad_rewards)),
                    first_sample=float(first),
                ),
            )
        mask = batch.loss_mask
        for name in ("advantages", "sampler_logprobs", "old_logprobs"):
            tensor = getattr(batch, name)
            if tensor is None:
                continue
            values = tensor[mask]
            count = int((~torch.isfinite(values)).sum())
            if count:
                findings.append(
                    self.finding(
                        f"{count} trainable tokens have a non-finite {name[:-1]}",
                        nonfinite_tokens=float(count),
                    )
                )
        if batch.sampler_logprobs is not None:
            sentinel = batch.sampler_logprobs[mask] <= self.config.sentinel_logprob_max
            count = int(sentinel.sum())
            if count:
                lowest = float(batch.sampler_logprobs[mask].min())
                findings.append(
                    self.finding(
                        f"{count} trainable tokens carry a sentinel sampler logprob "
                        f"(<= {self.config.sentinel_logprob_max:g}; lowest {lowest:g})",
                        sentinel_tokens=float(count),
                        lowest_logprob=lowest,
                    )
                )
        return findings

    def check_weights(
        self, weights: Iterable[torch.Tensor], cover: torch.Tensor | None = None
    ) -> list[Finding]:
        """After an apply: HALT when any weight tensor holds a non-finite value. `cover` is
        one tensor over a storage that holds all of `weights` (an engine that keeps its
        parameters in one buffer): then a healthy step costs one reduction, not one per
        tensor."""
        tensors = list(weights)
        if not tensors:
            return []
        with torch.no_grad():
            if cover is not None:  # a NaN or an infinity anywhere makes the sum non-finite
                total = float(cover.sum())
            else:  # one fused norm per tensor; norms are >= 0: no cancellation
                total = float(torch.stack(torch._foreach_norm(tensors)).sum())
            if math.isfinite(total):
                return []
            # the sum overflowed, or something is non-finite: count exactly, tensor by tensor
            bad = sum(1 for t in tensors if not bool(torch.isfinite(t).all()))
        if not bad:
            return []
        return [
            self.finding(
                f"{bad} of {len(tensors)} weight tensors are non-finite after the update",
                Action[self.config.weights_action],
                nonfinite_tensors=float(bad),
            )
        ]


def _finite_range(tensor: torch.Tensor) -> bool:
    """Every value finite: NaN or an infinity shows in the min or the max."""
    lowest, highest = torch.aminmax(tensor)
    return math.isfinite(float(lowest)) and math.isfinite(float(highest))
