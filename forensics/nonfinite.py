"""Where a non-finite value of a training pass was born: the first module, sample and token.

`FirstNonFinite(model)` puts a forward hook on every module of the model for the length of
a `with` block and keeps the first module (in execution order) whose input or output holds
a NaN or an inf: an input means it was born in the functional code just before that module
(attention, a norm, a residual add), an output in the module itself. `birth_token` maps the
first non-finite position of that tensor, `[rows', width, ...]` of a trunk layout, back to
the sample and token of the batch (engine/train/layout.py's `source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from grpod.engine import TransportBatch
from grpod.engine.train.layout import trunk_passes


@dataclass(frozen=True)
class Birth:
    """The first non-finite tensor a hook saw: `module`'s `where` ("input" | "output"), its
    `order` among the hooks that fired, and the flat index of its first non-finite element
    over the leading `[rows', width]` of its `shape`."""

    module: str
    where: str
    order: int
    shape: tuple[int, ...]
    position: int


class FirstNonFinite:
    """Forward hooks on every named module of `model` while the block runs; `birth` is the
    first non-finite input or output seen (None: every module's were finite)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.birth: Birth | None = None
        self._calls = 0
        self._handles: list[Any] = []

    def __enter__(self) -> FirstNonFinite:
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Any:
        def seen(module: torch.nn.Module, args: tuple, out: Any) -> None:
            self._calls += 1
            if self.birth is not None:
                return
            for where, values in (("input", args), ("output", (out,))):
                for tensor in _tensors(values):
                    bad = ~torch.isfinite(tensor.detach())
                    if bad.any():
                        first = int(bad.reshape(-1).nonzero()[0])
                        inner = max(1, tensor[0, 0].numel()) if tensor.dim() >= 2 else 1
                        self.birth = Birth(
                            name, where, self._calls, tuple(tensor.shape), first // inner
                        )
                        return

        return seen


def _tensors(values: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a hook's args or output (tuples and HF outputs alike)."""
    if isinstance(values, torch.Tensor):
        return [values] if values.is_floating_point() else []
    if isinstance(values, (tuple, list)):
        return [t for v in values for t in _tensors(v)]
    return []


def birth_token(
    batch: TransportBatch, sample: int, birth: Birth, joint: bool
) -> tuple[int | None, str]:
    """`(token, part)` of `birth` in a batch that trains `sample` alone (`only_sample`):
    `part` "completion" (token: its index in the completion) or "prompt" (its index in the
    prompt); `(None, "")` when the tensor is not laid out as the sample's trunk pass."""
    for micros, layout in trunk_passes(batch, joint):
        rows, width = layout.input_ids.shape
        if tuple(birth.shape[:2]) != (rows, width):
            continue
        hits = (layout.source == birth.position).nonzero().squeeze(-1).tolist()
        span = batch.input_ids.shape[1] * batch.seq_len
        for p in hits:
            micro, q = micros[0] + p // span, p % span
            owner = batch.sample_ids[micro].reshape(-1)
            if int(owner[q]) != sample:
                continue
            mine = (owner == sample).nonzero().squeeze(-1).tolist()
            trained = batch.loss_mask[micro].reshape(-1)[mine].tolist()
            prompt_len = trained.index(True) if True in trained else len(mine)
            k = mine.index(q)
            return (k - prompt_len, "completion") if k >= prompt_len else (k, "prompt")
    return None, ""
