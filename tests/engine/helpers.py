"""Small builders shared by the engine tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from grpod.engine import EngineConfig, TransportBatch
from grpod.engine.data.packing import Sample, pack
from grpod.engine.model.policy import seeded, trunk_sizes
from grpod.guards.workloads import W2_GEOMETRY

TINY = dict(prompts_per_step=4, group_size=4, task="copy", micro_batch_rows=2, seq_len=32)
W2 = dict(W2_GEOMETRY, prompts_per_step=4, group_size=2, micro_batch_rows=1, max_new_tokens=2)


# the GPU node check (bench/gpu_check.py) runs the engine tests with GRPOD_TEST_DEVICE=cuda
DEVICE = os.environ.get("GRPOD_TEST_DEVICE", "cpu")


def config(**overrides: object) -> EngineConfig:
    return EngineConfig.model_validate({**TINY, "device": DEVICE, **overrides})


def rollouts_with_signal(*engines: Any, tries: int = 8) -> list[TransportBatch]:
    """The engines' rollouts, in lock step, until the first engine's has a non-zero advantage
    (a batch of equal-reward groups has no gradient; which batch is the first with one depends
    on the device's random stream: the CPU's first is, a CUDA one's need not be)."""
    for _ in range(tries):
        batches = [engine.rollout() for engine in engines]
        if batches[0].advantages.abs().max() > 0:
            return batches
    raise AssertionError(f"{tries} rollouts without a learning signal")


def hand_batch(
    samples: list[tuple[list[int], int, float]],
    *,
    seq_len: int = 16,
    rows: int = 2,
    pack_rows: bool = True,
    chunks: int = 1,
) -> TransportBatch:
    """A batch from `(tokens, prompt_len, advantage)` triples, sampler logprobs all -1."""
    built = [
        Sample(tokens, prompt_len, adv, [-1.0] * (len(tokens) - prompt_len), group=i)
        for i, (tokens, prompt_len, adv) in enumerate(samples)
    ]
    return pack(
        built,
        seq_len=seq_len,
        micro_batch_rows=rows,
        pack_rows=pack_rows,
        pad_token_id=0,
        rewards=torch.zeros(len(samples)),
        step=0,
        config_digest="test",
        sequence_chunks=chunks,
    )


def tiny_llama() -> torch.nn.Module:
    """A Llama (no attention biases, 4 query heads per K/V head), random init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=15,
        **trunk_sizes(hidden=64, intermediate=128, layers=2, heads=8, kv_heads=2),
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return seeded(lambda: LlamaForCausalLM(cfg), 1).float()
