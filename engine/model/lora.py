"""LoRA adapters with PEFT (`[engine.lora]`, the `lora` extra).

`apply_lora` injects adapters into the policy in place and freezes the base weights, so the
engine keeps training a plain Hugging Face model whose only trainable parameters are the
adapters (the optimizer, the checkpoint and the guards see just those). Adapters are FP32
whatever `dtype` says (the trunk's bf16 autocast does not touch the parameters), which keeps
their gradient accumulation exact. The KL reference is the same model with its adapters
disabled (`reference_mode`), not a second copy.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from grpod.base.oneline import one_line
from grpod.engine.config import LoraConfig
from grpod.engine.errors import EngineError
from grpod.engine.model.policy import seeded


def apply_lora(model: torch.nn.Module, settings: LoraConfig, seed: int) -> Any:
    """Inject adapters into `model` (in place); returns the PEFT handle (a `PeftModel`)."""
    try:
        import peft
    except ImportError:
        raise EngineError(
            "engine.lora: peft is not installed (pip install 'grpod[lora]')"
        ) from None
    lora = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    _refuse_tied_targets(model, lora)
    try:
        # adapter init from the run's seed alone
        adapters = seeded(lambda: peft.get_peft_model(model, lora), seed)
    except ValueError as exc:
        raise EngineError(f"engine.lora: {one_line(exc, with_type=False)}") from None
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    model.grpod_adapters = True  # the fused decoder and trunk do not apply adapters
    return adapters


def _refuse_tied_targets(model: torch.nn.Module, lora: Any) -> None:
    """A target whose weight is the input embeddings' (a tied `lm_head`), refused by name: the
    FP32 chunked head reads that weight itself, so its adapter would get no gradient."""
    from peft.tuners.tuners_utils import check_target_module_exists

    embeddings = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is embeddings or getattr(module, "weight", None) is not embeddings.weight:
            continue
        if check_target_module_exists(lora, name):
            raise EngineError(
                f"engine.lora: target_modules: {name} shares its weight with the input "
                "embeddings (tie_word_embeddings); an adapter there is not supported (the FP32 "
                f"chunked head reads that weight directly): remove {name} from target_modules"
            )


def has_adapters(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "grpod_adapters", False))


def reference_mode(adapters: Any) -> contextlib.AbstractContextManager:
    """The base model: the adapters disabled for the block (the KL reference)."""
    return adapters.disable_adapter()
