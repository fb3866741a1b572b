"""Packing samples into a `TransportBatch`: rows of `seq_len`, grouped into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import TransportBatch
from engine.errors import EngineError


@dataclass(frozen=True)
class Sample:
    """One prompt + completion, target-aligned: `trainable[p]` marks completion token p."""

    tokens: list[int]
    prompt_len: int
    advantage: float
    sampler_logprobs: list[float]  # one per completion token
    group: int


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the first row it fits."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack(
    samples: list[Sample],
    *,
    seq_len: int,
    micro_batch_rows: int,
    pack_rows: bool,
    pad_token_id: int,
    rewards: torch.Tensor,
    step: int,
    config_digest: str,
    sequence_chunks: int = 1,
    meta: dict | None = None,
) -> TransportBatch:
    """Lay samples into rows (first-fit decreasing, or one per row), rows into micros."""
    lengths = [len(s.tokens) for s in samples]
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise EngineError(f"sample {i}: {n} tokens do not fit seq_len {seq_len}")
        if samples[i].prompt_len < 1:
            raise EngineError(f"sample {i}: an empty prompt leaves nothing to score token 0")
    rows = (
        first_fit_decreasing(lengths, seq_len) if pack_rows else [[i] for i in range(len(samples))]
    )
    micros = -(-len(rows) // micro_batch_rows)
    shape = (micros * micro_batch_rows, seq_len)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    advantages = torch.zeros(shape, dtype=torch.float32)
    sampler_lp = torch.zeros(shape, dtype=torch.float32)
    sample_ids = torch.full(shape, -1, dtype=torch.int32)
    group_ids = torch.full(shape, -1, dtype=torch.int32)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            s, n = samples[i], lengths[i]
            span = slice(at, at + n)
            completion = slice(at + s.prompt_len, at + n)
            input_ids[r, span] = torch.tensor(s.tokens)
            position_ids[r, span] = torch.arange(n)
            loss_mask[r, completion] = True
            advantages[r, completion] = s.advantage
            sampler_lp[r, completion] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
            sample_ids[r, span] = i
            group_ids[r, span] = s.group
            at += n

    def fold(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(micros, micro_batch_rows, seq_len)

    return TransportBatch(
        input_ids=fold(input_ids),
        position_ids=fold(position_ids),
        loss_mask=fold(loss_mask),
        advantages=fold(advantages),
        sampler_logprobs=fold(sampler_lp),
        sample_ids=fold(sample_ids),
        group_ids=fold(group_ids),
        rewards=rewards.float(),
        sample_group_ids=torch.tensor([s.group for s in samples], dtype=torch.int32),
        completion_lengths=torch.tensor(
            [n - s.prompt_len for s, n in zip(samples, lengths)], dtype=torch.int32
        ),
        step=step,
        config_digest=config_digest,
        sequence_chunks=sequence_chunks,
        meta=meta or {},
    )


def attention_mask(sample_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask `[rows, 1, seq, seq]` bool from `sample_ids: [rows, seq]`.

    A token attends to earlier tokens of its own sample only; padding attends to itself so
    no softmax row is empty.
    """
    seq = sample_ids.shape[-1]
    same = sample_ids[:, :, None] == sample_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    eye = torch.eye(seq, dtype=torch.bool)
    return ((same & causal) | eye)[:, None]
