"""The step's valid-token counter: zeroed once per step, added to by every chunk's loss code."""

from __future__ import annotations

import torch


class ValidTokenCounter:
    """Counts trainable tokens over every chunk of every micro of one step.

    `per_chunk_reset=True` reproduces the known defect for drills: the counter is re-zeroed on
    every chunk invocation, so the step reads only the last chunk that ran.
    """

    def __init__(self, per_chunk_reset: bool = False) -> None:
        self.per_chunk_reset = per_chunk_reset
        self._count = torch.zeros((), dtype=torch.int64)

    def start_step(self) -> None:
        self._count = torch.zeros((), dtype=torch.int64)

    def start_chunk(self) -> None:
        if self.per_chunk_reset:
            self._count = torch.zeros((), dtype=torch.int64)

    def add(self, chunk_mask: torch.Tensor) -> torch.Tensor:
        """Add a chunk's trainable tokens; returns the chunk's own count (a 0-dim tensor)."""
        n = chunk_mask.sum()
        self._count = self._count + n
        return n

    @property
    def value(self) -> int:
        return int(self._count)


def token_scale(global_valid_tokens: int) -> float:
    """The step's one divisor of the loss and the gradients: 1 / the global valid-token count
    (every micro, every chunk, every rank of the step), never one micro's or one rank's
    count. A step with no trainable token has nothing to scale (1)."""
    return 1.0 / max(global_valid_tokens, 1)
