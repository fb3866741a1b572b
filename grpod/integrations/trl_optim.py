"""An optimizer whose `step()` can decline, and an LR schedule that follows it.

The transformers `Trainer` calls `optimizer.step()` unconditionally (after
`on_pre_optimizer_step`) and then `lr_scheduler.step()` unless accelerate's grad scaler
skipped the step. `DecliningOptimizer.step()` asks `decide()` first: a declined step runs no
`inner.step()`, so the weights and AdamW's moments and step counts stay bit-identical, and
`FollowingScheduler.step()` then does nothing, so the schedule position stays too. The
gradients are discarded by the Trainer's `model.zero_grad()` that follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class DecliningOptimizer(torch.optim.Optimizer):
    """`inner` (the optimizer TRL built), stepped only when `decide(apply)` applies it.

    `decide(apply)` is given a function that runs `inner.step()` and returns True when it did.
    A subclass of `torch.optim.Optimizer` (accelerate wraps only those), delegating all of
    its state to `inner`: `state_dict()` is `inner`'s, a checkpoint is TRL's as ever.
    """

    def __init__(self, inner: torch.optim.Optimizer, decide: Callable[[Callable[[], None]], bool]):
        # no Optimizer.__init__: param_groups, state and defaults are inner's, not copies
        self.inner = inner
        self.decide = decide
        self.declined = False  # the last step() declined
        self.declined_total = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        applied = self.decide(lambda: self.inner.step(closure))
        self.declined = not applied
        self.declined_total += not applied
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:  # anything else TRL or accelerate reads
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"DecliningOptimizer({self.inner!r})"


class FollowingScheduler:
    """`inner` (the LR schedule TRL built), stepped only after an applied optimizer step."""

    def __init__(self, inner: Any, optimizer: DecliningOptimizer) -> None:
        self.inner = inner
        self.optimizer_wrapper = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.optimizer_wrapper.declined:
            self.inner.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.inner.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
