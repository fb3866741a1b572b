"""Replay of a recorded TRL step through TRL's own loss (`grpod replay` on a TRL run).

From the TRL checkpoint at or before the step (`checkpoint-N/`: weights, `optimizer.pt`,
`scheduler.pt`) and the GRPOConfig recorded as JSON with the run (`trl.args` of the run's
config in the store, written when the run started), a plain `trl.GRPOTrainer` is rebuilt whose
`_prepare_inputs` hands back each recorded micro-batch (`trl_batch.micro_inputs`); every
recorded step from the checkpoint on runs TRL's `training_step` per micro, the Trainer's
clip and grad norm, and then the optimizer and schedule step when the step was applied (a
flushed step only discards its gradients), as the Trainer's loop does. The target step's
loss, grad norm, valid tokens (TRL's recorded num_items_in_batch, the divisor it used) and
the mask's sum are compared with the record, bit for bit. Nothing is written.

A run dir is data, possibly someone else's: nothing in it is unpickled. TRL's
`training_args.bin` is a pickle and is never read (a run dir without the recorded GRPOConfig
is refused); the optimizer and schedule states are loaded by transformers with
`weights_only=True`.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from grpod.base.jsonsafe import to_json
from grpod.engine.verdict import Outcome
from grpod.forensics.errors import ForensicsError
from grpod.forensics.step_replay import (
    ReplayResult,
    bit_equal,
    classify,
    opened_plan,
    plan_fields,
)
from grpod.integrations.trl_batch import micro_inputs

COMPARED = ("valid_tokens", "expected_valid_tokens", "loss", "grad_norm")


def is_trl_run(config: dict[str, Any]) -> bool:
    return isinstance(config.get("trl"), dict) and config["trl"].get("trainer") == "trl"


def replay(
    run_dir: str | os.PathLike,
    step: int | None = None,
    incident_id: int | None = None,
    *,
    store_url: str = "",
) -> ReplayResult:
    """Replay `step` (or the step of `incident_id`) of a guarded TRL run in `run_dir`."""
    with opened_plan(run_dir, store_url, step, incident_id) as (store, planned):
        config, _versions, checkpoint, plan = planned
        path = store.checkpoint_path(checkpoint)
    if any(item.batch.world_size > 1 for item in plan):
        raise ForensicsError(
            f"step {plan[-1].report.step}: recorded under several processes; replay of a "
            "distributed TRL step is not supported"
        )
    recorded_args = _recorded_args(config, run_dir)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = _restore(Path(path), recorded_args, scratch)
        diverged_at = diverged_field = None
        replayed: dict[str, Any] = {}
        for item in plan:
            applied = item.row.outcome == Outcome.APPLIED
            numbers = _rerun(trainer, item.batch, item.report.valid_tokens, applied)
            recorded = _recorded(item.report)
            if diverged_at is None:
                diverged_field = next(
                    (k for k in COMPARED if not bit_equal(recorded[k], numbers[k])), None
                )
                if diverged_field is not None:
                    diverged_at = item.report.step
            replayed = numbers
    reproduced = diverged_at is None
    return ReplayResult(
        reproduced=reproduced,
        recorded={k: to_json(v) for k, v in _recorded(plan[-1].report).items()},
        replayed={k: to_json(v) for k, v in replayed.items()},
        classification=classify(plan[-1], reproduced),
        diverged_at=diverged_at,
        field=diverged_field,
        note="TRL run: valid_tokens is the recorded num_items_in_batch TRL divided by",
        **plan_fields(plan, checkpoint, incident_id),
    )


def _recorded(report: Any) -> dict[str, Any]:
    return {
        "valid_tokens": report.valid_tokens,
        "expected_valid_tokens": report.expected_valid_tokens,
        "loss": report.loss,
        "grad_norm": report.grad_norm,
    }


def _recorded_args(config: dict[str, Any], run_dir: str | os.PathLike) -> dict[str, Any]:
    """The GRPOConfig the run recorded (`GRPOConfig.to_dict()`, grpod.integrations.trl)."""
    trl = config.get("trl")
    args = trl.get("args") if isinstance(trl, dict) else None
    if not isinstance(args, dict) or not args:
        raise ForensicsError(
            f"run dir {run_dir}: no recorded GRPOConfig (trl.args in the run's config); "
            "replay never unpickles training_args.bin"
        )
    return args


def grpo_config(recorded: dict[str, Any], **override: Any) -> Any:
    """A `GRPOConfig` rebuilt from its recorded `to_dict()` JSON and `override`. Fields that
    `__post_init__` derives from others are recomputed (passed back, TRL refuses both
    `generation_batch_size` and `steps_per_generation`); masked tokens stay unset."""
    from dataclasses import fields

    from trl import GRPOConfig

    init = {f.name for f in fields(GRPOConfig) if f.init}
    values = {
        k: v
        for k, v in recorded.items()
        if k in init and not (k.endswith("_token") and v == f"<{k.upper()}>")
    }
    if values.get("steps_per_generation") is not None:
        values.pop("generation_batch_size", None)
    values.update(override)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return GRPOConfig(**values)
    except (TypeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ForensicsError(f"the recorded GRPOConfig does not rebuild: {first}") from None


def _restore(checkpoint: Path, recorded_args: dict[str, Any], scratch: str) -> Any:
    """A `GRPOTrainer` in the checkpoint's state, whose micro-batches come from the record."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    class _Recorded(GRPOTrainer):
        def _prepare_inputs(self, generation_batch: Any) -> Any:
            return generation_batch  # a recorded micro, as `_compute_loss` took it

    args = grpo_config(recorded_args, output_dir=scratch, report_to=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        trainer = _Recorded(
            model=model,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "replay"}]),
            processing_class=tokenizer,
        )
    trainer.create_optimizer_and_scheduler(num_training_steps=max(args.max_steps, 1))
    trainer._load_optimizer_and_scheduler(str(checkpoint))
    trainer.model.train()
    return trainer


def _rerun(trainer: Any, batch: Any, num_items: int, applied: bool) -> dict[str, Any]:
    """One recorded step as the Trainer's loop runs it: each micro's training_step, the clip
    and grad norm, then the optimizer and schedule step if it was applied."""
    micros = micro_inputs(batch, num_items)
    trainer.current_gradient_accumulation_steps = len(micros)
    losses = []
    for i, inputs in enumerate(micros):
        trainer.accelerator.gradient_state._set_sync_gradients(i == len(micros) - 1)
        losses.append(float(trainer.training_step(trainer.model, inputs, None)))
    clipped = trainer._clip_grad_norm(trainer.model) if trainer.args.max_grad_norm > 0 else None
    grad_norm = float(trainer._get_grad_norm(trainer.model, grad_norm=clipped))
    if applied:
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    trainer.model.zero_grad()
    return {
        "valid_tokens": num_items,
        "expected_valid_tokens": int(batch.loss_mask.sum()),
        "loss": math.fsum(losses),
        "grad_norm": grad_norm,
    }
