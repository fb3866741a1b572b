"""Async steps with bounded staleness (`max_staleness = k`): rollouts sampled ahead.

When step N is rolled out, the window holds the rollouts of steps N .. N+k, each launched
with the weights the policy had at its launch: step N+k's is launched now, at weight version
v(N) (the updates applied before step N), and samples while steps N .. N+k-1 train (on a
vllm-server's background thread; every other backend samples at launch). When N+k trains,
the policy has applied at most k more updates: its staleness (the policy's weight version
when it trains minus the version it sampled with) is at most k.

- **Accounted by version, never by step.** A flushed or skipped step applies no update, so
  the rollouts in flight were sampled from weights the policy still has, or had k versions
  ago at most: they stay and their staleness is smaller (a flush costs them nothing). The
  window never samples from weights the policy does not have: only applied updates are
  pushed. A HALT ends the run, and its rollouts in flight with it; a restart resumes from
  the checkpoint and samples its window again from the checkpoint's weights.
- **Dropped, never trained on.** A rollout more than k versions old when its step comes (a
  sampler that ran ahead of its bound; the `stale_rollout_steps` drill makes one) is
  dropped, counted (`dropped`), and its step sampled again with the policy's current weights
  (staleness 0): the step's prompts stay the step's.
- Each batch records the version it sampled with (`weight_version`) and its `staleness`;
  the recorded batch is the whole input of a replay (the sampler logprobs correct for the
  older policy through truncated importance sampling, which `max_staleness > 0` requires).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpod.engine.rollout.sampling import Pending

__all__ = ["Ahead", "AheadStats", "Dropped"]


@dataclass(frozen=True)
class Dropped:
    """A rollout dropped instead of trained on."""

    step: int
    weight_version: int  # the version it sampled with
    staleness: int  # how many versions old it was when its step came
    reason: str  # "stale"


@dataclass(frozen=True)
class AheadStats:
    """What the window did for one step: the rollout's seconds that ran beside the trainer's
    work, and the rollouts it dropped."""

    overlap_seconds: float = 0.0
    dropped: tuple[Dropped, ...] = ()


class Ahead:
    """The window of rollouts ahead of the step in training (see the module doc)."""

    def __init__(
        self,
        max_staleness: int,
        launch: Callable[[int], Pending],
        version: Callable[[], int],
        early: Callable[[int], bool] = lambda step: False,
    ) -> None:
        self.max_staleness = max_staleness
        self.launch, self.version, self.early = launch, version, early
        self.horizon: int | None = None  # no rollout launched for a step at or past it
        self._window: dict[int, Pending] = {}
        self._dropped: list[Dropped] = []
        self._overlap = 0.0

    def take(self, step: int) -> tuple[Pending, int]:
        """Step `step`'s rollout (launched now if it is not in the window) and its staleness,
        once the window holds the steps up to `step + max_staleness`."""
        for old in [s for s in self._window if s < step]:  # the cursor moved past them
            del self._window[old]
        last = step + self.max_staleness
        for s in range(step, last + 2):
            if s > last and not self.early(s):
                break
            if s not in self._window and (s == step or self.horizon is None or s < self.horizon):
                self._window[s] = self.launch(s)
        pending = self._window.pop(step)
        pending.result()  # wait here: a failure is the step's (and its overlap is known)
        staleness = self.version() - pending.version
        if staleness > self.max_staleness:
            self._dropped.append(Dropped(step, pending.version, staleness, "stale"))
            pending = self.launch(step)  # the policy's weights now: staleness 0
            pending.result()
            staleness = self.version() - pending.version
        self._overlap += pending.overlap_seconds
        return pending, staleness

    def take_stats(self) -> AheadStats:
        """What the window did since the last take (the daemon's metrics and log)."""
        stats = AheadStats(self._overlap, tuple(self._dropped))
        self._overlap, self._dropped = 0.0, []
        return stats

    def clear(self) -> None:
        """Forget every rollout in the window (a checkpoint restored: they are not its)."""
        self._window.clear()
