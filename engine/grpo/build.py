"""`build_parts`: what an `Engine` is made of, built from its config in one place.

The task and its rewards, the policy and tokenizer (with LoRA adapters when configured),
the KL reference, the unsharded rollout copy, the trained model (FSDP-sharded or plain),
the module the training trunk runs through (DDP's wrapper or the model) and its trainable
parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from grpod.engine.config import EngineConfig
from grpod.engine.data.rewardcall import NonFinite
from grpod.engine.data.rewards import RewardSet
from grpod.engine.data.tasks import Task, config_task
from grpod.engine.data.tokenizer import require_chat_template
from grpod.engine.errors import EngineError
from grpod.engine.kvcache import KVCacheSpec
from grpod.engine.model.flat import flatten_parameters
from grpod.engine.model.fused import unsupported as decoder_unsupported
from grpod.engine.model.lora import apply_lora
from grpod.engine.model.parallel import Parallel
from grpod.engine.model.policy import load_policy, resolve_device
from grpod.engine.rollout.stop_strings import stop_token_ids


@dataclass(frozen=True)
class EngineParts:
    task: Task
    rewards: RewardSet
    device: torch.device
    model: torch.nn.Module  # the trained model: FSDP-sharded under torchrun's fsdp2, or plain
    tokenizer: Any  # a transformers tokenizer, or the built-in CharTokenizer
    stop_token_ids: list[int]
    kv_cache: KVCacheSpec | None  # the rollout's bounded KV cache; None: dense
    adapters: Any  # LoRA: the PEFT handle (adapters injected in place, base frozen); or None
    reference: torch.nn.Module | None  # the frozen KL reference copy (kl_beta > 0, no LoRA)
    rollout_model: torch.nn.Module  # unsharded: rollout and scoring run no collective
    train_trunk: torch.nn.Module  # what the training trunk runs through: DDP's wrapper or model
    params: list[torch.nn.Parameter]  # the trainable parameters


def build_parts(config: EngineConfig, parallel: Parallel) -> EngineParts:
    task = config_task(config)
    device = resolve_device(parallel.device(config.device))
    model, tokenizer = load_policy(config.model, task.chars, config.seq_len)
    kv_cache = config.kv_cache_spec
    if kv_cache is not None and decoder_unsupported(model) is not None:
        raise EngineError(
            f"model {config.model}: rollout_kv_cache {kv_cache.policy!r} needs the "
            f"fused decoder, which does not cover it ({decoder_unsupported(model)})"
        )
    adapters = apply_lora(model, config.lora, config.seed) if config.lora.rank else None
    model.to(device)
    require_chat_template(tokenizer, config.prompt_format)
    rewards = RewardSet(  # a NaN reward is the step's fault: the finite guard flushes it
        task,
        config.rewards,
        config.reward_weights,
        config.reward_timeout_seconds,
        non_finite=NonFinite.PASS,
    )
    stops = stop_token_ids(tokenizer, model)
    trained = copy.deepcopy(model) if parallel.sharded else model
    flatten_parameters(model)  # one storage for every parameter: the weights check is one op
    reference = (  # with LoRA the reference is the base: the adapters disabled
        copy.deepcopy(model).requires_grad_(False)
        if config.kl_beta > 0 and adapters is None
        else None
    )
    rollout_model = model
    if parallel.sharded:
        model = parallel.shard(trained, config.dtype)
    train_trunk = parallel.replicate(model, config.dtype) if parallel.replicated else model
    return EngineParts(
        task=task,
        rewards=rewards,
        device=device,
        model=model,
        tokenizer=tokenizer,
        stop_token_ids=stops,
        kv_cache=kv_cache,
        adapters=adapters,
        reference=reference,
        rollout_model=rollout_model,
        train_trunk=train_trunk,
        params=[p for p in model.parameters() if p.requires_grad],
    )
