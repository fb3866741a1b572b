"""Small builders shared by the engine tests."""

from __future__ import annotations

import torch

from engine import EngineConfig, TransportBatch
from engine.packing import Sample, pack

TINY = dict(prompts_per_step=4, group_size=4, task="copy", micro_batch_rows=2, seq_len=32)
W2 = dict(
    task="kv-retrieval",
    seq_len=256,
    sequence_chunks=4,
    lmhead_chunks=4,
    prompts_per_step=4,
    group_size=2,
    micro_batch_rows=1,
    max_new_tokens=2,
)


def config(**overrides: object) -> EngineConfig:
    return EngineConfig.model_validate({**TINY, **overrides})


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
