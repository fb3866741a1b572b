"""`accounting`: the zero-lr flush. A step whose token accounting is corrupt is never applied."""

from __future__ import annotations

from grpod.engine import StepReport, TransportBatch
from grpod.guards.base import Guard
from grpod.guards.verdict import Finding


class AccountingGuard(Guard):
    """FLUSH when `valid_tokens == 0` on a step with micros; in `strict` mode (the default) also
    when `valid_tokens != expected_valid_tokens`. `nonzero` mode is for engines whose counter is
    per-micro by design. Under torch.distributed (strict) also when the global count the loss is
    divided by is not the sum over ranks of their expected counts (all-gathered): a mismatch on
    one rank flushes the step on all of them (the policy max-reduces the verdict)."""

    name = "accounting"

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]:
        valid, expected = report.valid_tokens, report.expected_valid_tokens
        evidence = dict(
            valid_tokens=float(valid),
            expected_valid_tokens=float(expected),
            num_micros=float(report.num_micros),
        )
        if report.num_micros > 0 and valid == 0:
            return [self.finding(f"valid_tokens is 0 (expected {expected})", **evidence)]
        if self.config.mode != "strict":
            return []
        if valid != expected:
            return [
                self.finding(
                    f"valid_tokens {valid} != expected {expected} (loss mask sum)", **evidence
                )
            ]
        total, ranks = report.global_valid_tokens, report.rank_expected_valid_tokens
        if total is not None and ranks and total != sum(ranks):
            evidence.update(global_valid_tokens=float(total), expected_global=float(sum(ranks)))
            return [
                self.finding(
                    f"global valid_tokens {total} != {sum(ranks)}, the sum over "
                    f"{len(ranks)} ranks of their expected counts {ranks}",
                    **evidence,
                )
            ]
        return []
