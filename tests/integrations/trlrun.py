"""A tiny guarded TRL campaign on the CPU: a real HF Qwen2 + BPE tokenizer (tests/hfdir.py),
real `trl.GRPOTrainer` steps, and faults injected by step number through the trainer's own
overridable methods (the identity on every other step)."""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.hfdir import build_hf_dir

ROWS, MICROS, GROUP = 2, 2, 2  # per micro, micros per step, completions per prompt
MAX_COMPLETION = 3


@dataclass
class Faults:
    """Step numbers (TRL's global_step) at which each fault is injected."""

    nan_advantage: set[int] = field(default_factory=set)  # one advantage NaN: the loss is NaN
    inf_gradient: set[int] = field(default_factory=set)  # an embedding gradient becomes inf
    halve_num_items: set[int] = field(default_factory=set)  # num_items_in_batch // 2
    rank: int | None = None  # inject only on this rank (None: every rank)


def reward(completions: list[Any], **_: Any) -> list[float]:
    return [float(len(str(c)) % 3) for c in completions]


def constant_reward(completions: list[Any], **_: Any) -> list[float]:
    return [1.0] * len(completions)


def state_digest(trainer: Any) -> str:
    """sha256 of the weights, the optimizer state and the LR schedule's state."""
    h = hashlib.sha256()
    for name, tensor in sorted(trainer.model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    _hash_tree(h, trainer.optimizer.state_dict())
    _hash_tree(h, trainer.lr_scheduler.state_dict())
    return h.hexdigest()


def _hash_tree(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _hash_tree(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _hash_tree(h, v)
    elif not callable(value):
        h.update(repr(value).encode())


def build_trainer(
    root: Path,
    *,
    max_steps: int,
    faults: Faults | None = None,
    reward_func: Any = reward,
    guards: dict | None = None,
    collapse: float = 1.0,
    metrics_port: int | None = None,
    **trl_args: Any,
) -> Any:
    """A `GuardedGRPOTrainer` whose run dir is `root/run`, TRL output `root/out`. `collapse`
    scales the (tied) embeddings: a large factor makes the policy near-deterministic."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from grpod.guards.config import GuardsConfig
    from grpod.integrations.trl import OFF_FOR_TRL, GrpodTRLConfig, GuardedGRPOTrainer

    model_dir = root / "model"
    if not model_dir.is_dir():
        build_hf_dir(model_dir)
    warnings.filterwarnings("ignore")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if collapse != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(collapse)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = Dataset.from_list([{"prompt": f"What is {i}+{i % 3}?"} for i in range(64)])
    settings = dict(
        output_dir=str(root / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=MICROS,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    args = GRPOConfig(**{**settings, **trl_args})
    config = GuardsConfig.model_validate({**OFF_FOR_TRL, **(guards or {})})
    grpod = GrpodTRLConfig(run_dir=str(root / "run"), guards=config, metrics_port=metrics_port)
    cls = _faulty(GuardedGRPOTrainer, faults) if faults else GuardedGRPOTrainer
    return cls(
        model=model,
        reward_funcs=[reward_func],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        grpod=grpod,
    )


def _faulty(base: type, faults: Faults) -> type:
    """`base` with `faults` injected at their steps (the identity on every other step)."""

    class Faulty(base):  # type: ignore[misc, valid-type]
        def _here(self, steps: set[int]) -> bool:
            mine = faults.rank is None or faults.rank == self.accelerator.process_index
            return mine and self.state.global_step in steps

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            output = super()._generate_and_score_completions(inputs)
            if self._here(faults.nan_advantage):
                output["advantages"] = output["advantages"].clone()
                output["advantages"][0] = math.nan
            if self._here(faults.halve_num_items):
                output["num_items_in_batch"] = output["num_items_in_batch"] // 2
            return output

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            if not self._here(faults.inf_gradient):
                return super().training_step(model, inputs, num_items_in_batch)
            weight = model.get_input_embeddings().weight
            handle = weight.register_hook(lambda g: g * math.inf)
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                handle.remove()

    return Faulty
