"""A checkpoint's policy as a Hugging Face directory that `from_pretrained` loads.

`export_pretrained(config, checkpoint, out)` writes `config.json`, `model.safetensors`,
`generation_config.json` and the run's tokenizer (the model directory's own, or the built-in
character tokenizer as a `tokenizers` WordLevel one) to `out`, built beside it and renamed
into place, so `out` is complete or absent. A checkpoint written under torchrun (FSDP2, one
DCP directory of every rank's shards) is consolidated into the same one directory.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpod.base.fileio import atomic_dir
from grpod.base.oneline import one_line
from grpod.engine.config import EngineConfig
from grpod.engine.data.inputs import BUILTIN_MODEL
from grpod.engine.data.tasks import task_chars
from grpod.engine.errors import EngineError
from grpod.engine.model.lora import apply_lora
from grpod.engine.model.policy import load_policy
from grpod.engine.state import distcp


def export_pretrained(
    config: EngineConfig, checkpoint: Path, out: Path, adapter: bool = False
) -> Path:
    """Write the policy of `checkpoint` (a run's engine checkpoint dir) as an HF dir `out`:
    with LoRA the adapters merged into the base weights, or (`adapter`) the PEFT adapter
    directory alone (`adapter_config.json`, `adapter_model.safetensors`)."""
    if adapter and not config.lora.rank:
        raise EngineError("export --adapter: the run has no LoRA adapters ([engine.lora] rank 0)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EngineError(f"export {out}: exists and is not an empty directory")
    sharded = distcp.is_dcp(checkpoint)  # written under torchrun: every rank's shards
    weights_file = checkpoint / "model.safetensors"
    if not sharded and not weights_file.is_file():
        raise EngineError(f"checkpoint {checkpoint}: missing model.safetensors")
    # only the built-in model's character tokenizer is made from the task's text
    chars = task_chars(config.task) if config.model == BUILTIN_MODEL else ""
    model, tokenizer = load_policy(config.model, chars, config.seq_len)
    adapters = apply_lora(model, config.lora, config.seed) if config.lora.rank else None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if sharded:
        weights = distcp.load_model_weights(checkpoint, params)
    else:
        try:
            weights = load_file(str(weights_file))
        except Exception as exc:  # safetensors raises bare errors on truncated files
            raise EngineError(
                f"checkpoint {checkpoint}: unreadable model.safetensors: {exc}"
            ) from None
    if set(weights) != set(params):
        raise EngineError(f"checkpoint {checkpoint}: weights do not match the run's model")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    if adapters is not None and not adapter:
        model = adapters.merge_and_unload()  # W + alpha / r * B A, adapters removed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for the one line an error gets
    try:
        with atomic_dir(out) as tmp:  # fsynced, renamed over the empty `out`; else removed
            if adapter:
                adapters.save_pretrained(tmp, safe_serialization=True)
            else:
                model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.to_hf().save_pretrained(tmp)
    except Exception as exc:  # nothing partial is left, whatever stopped the write
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        if getattr(exc, "errno", None) in DISK_FULL or "os error 28" in str(exc):
            raise OSError(f"export {out}: cannot write: {reason}") from None  # exit 1
        raise EngineError(f"export {out}: cannot write: {reason}") from None
    return out


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the machine's fault, not the argument's
