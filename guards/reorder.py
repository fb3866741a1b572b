"""`reorder` (before): make a per-micro token counter read a non-zero count.

An engine whose counter is re-zeroed per chunk and runs chunks in reverse reads, at step end,
chunk 0 of the last micro. Running the micro with the largest chunk-0 valid count last makes
that read non-zero; when no micro has a trainable token in chunk 0 (an all-long-prompt batch)
no order helps, so the compute is skipped and the step flushed ("skip-fast").
"""

from __future__ import annotations

from typing import Any

from grpod.engine import TransportBatch
from grpod.guards.base import Guard
from grpod.guards.errors import GuardsError
from grpod.guards.verdict import Action, Finding


class ReorderGuard(Guard):
    """Run by the policy only when the engine's accounting is per-micro (or configured so)."""

    name = "reorder"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.skip_fast_total = 0
        self.reordered_total = 0

    def before(self, batch: TransportBatch) -> tuple[TransportBatch | None, list[Finding]]:
        if batch.num_micros == 0:
            return batch, []
        chunk0 = batch.chunk_valid_counts()[:, 0]  # [micros] trainable tokens in chunk 0
        best = int(chunk0.argmax())
        evidence = dict(
            num_micros=float(batch.num_micros),
            chunk0_valid_max=float(chunk0[best]),
            expected_valid_tokens=float(batch.expected_valid_tokens()),
        )
        if int(chunk0[best]) == 0:
            self.skip_fast_total += 1
            return None, [
                self.finding(
                    "skip-fast: no micro has a trainable token in chunk 0, so a per-micro "
                    "counter would read 0",
                    Action[self.config.skip_action],
                    skip_fast_total=float(self.skip_fast_total),
                    **evidence,
                )
            ]
        last = batch.num_micros - 1
        if best == last:
            return batch, []
        self.reordered_total += 1
        order = [i for i in range(batch.num_micros) if i != best] + [best]
        message = f"moved micro {best} (chunk-0 valid {int(chunk0[best])}) to the last slot"
        return batch.reorder(order), [
            self.finding(message, Action.PASS, moved_micro=float(best), **evidence)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"skip_fast_total": self.skip_fast_total, "reordered_total": self.reordered_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.skip_fast_total = int(state.get("skip_fast_total", 0))
            self.reordered_total = int(state.get("reordered_total", 0))
        except (TypeError, ValueError):
            raise GuardsError(f"guard {self.name}: saved counters are not integers") from None
