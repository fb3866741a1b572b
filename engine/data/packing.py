"""Packing samples into a `TransportBatch`: rows of `seq_len`, grouped into micro-batches.

Row packing only; how the packed rows then run through the trunk is engine/train/layout.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.errors import EngineError


@dataclass(frozen=True)
class Sample:
    """One prompt + completion, target-aligned: `trainable[p]` marks completion token p."""

    tokens: list[int]
    prompt_len: int
    advantage: float
    sampler_logprobs: list[float]  # one per completion token
    group: int


def group_samples(
    prompt_ids: list[list[int]],
    completions: list[list[int]],
    advantages: list[float],
    sampler_logprobs: list[list[float]],
    group_size: int,
    first_group: int,
) -> list[Sample]:
    """`group_size` completions per prompt, in order, as samples of groups `first_group`..."""
    return [
        Sample(
            tokens=prompt_ids[i // group_size] + ids,
            prompt_len=len(prompt_ids[i // group_size]),
            advantage=advantage,
            sampler_logprobs=sampler_logprobs[i],
            group=first_group + i // group_size,
        )
        for i, (ids, advantage) in enumerate(zip(completions, advantages))
    ]


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
    generation: int = 0,
    injected_faults: tuple[str, ...] = (),
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
    size = shape[0] * seq_len
    # host lists filled slice by slice, then one tensor per field (no per-sample tensors)
    input_ids, position_ids = [pad_token_id] * size, [0] * size
    loss_mask, advantages, sampler_lp = [False] * size, [0.0] * size, [0.0] * size
    sample_ids, group_ids = [-1] * size, [-1] * size
    for r, members in enumerate(rows):
        at = r * seq_len
        for i in members:
            s, n = samples[i], lengths[i]
            start, end = at + s.prompt_len, at + n
            if len(s.sampler_logprobs) != n - s.prompt_len:
                raise EngineError(
                    f"sample {i}: {len(s.sampler_logprobs)} sampler logprobs for "
                    f"{n - s.prompt_len} completion tokens"
                )
            input_ids[at:end] = s.tokens
            position_ids[at:end] = range(n)
            loss_mask[start:end] = [True] * (end - start)
            advantages[start:end] = [s.advantage] * (end - start)
            sampler_lp[start:end] = s.sampler_logprobs
            sample_ids[at:end] = [i] * n
            group_ids[at:end] = [s.group] * n
            at = end

    def fold(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).reshape(micros, micro_batch_rows, seq_len)

    return TransportBatch(
        input_ids=fold(input_ids, torch.int64),
        position_ids=fold(position_ids, torch.int64),
        loss_mask=fold(loss_mask, torch.bool),
        advantages=fold(advantages, torch.float32),
        sampler_logprobs=fold(sampler_lp, torch.float32),
        sample_ids=fold(sample_ids, torch.int32),
        group_ids=fold(group_ids, torch.int32),
        rewards=rewards.float(),
        sample_group_ids=torch.tensor([s.group for s in samples], dtype=torch.int32),
        completion_lengths=torch.tensor(
            [n - s.prompt_len for s, n in zip(samples, lengths)], dtype=torch.int32
        ),
        step=step,
        config_digest=config_digest,
        sequence_chunks=sequence_chunks,
        generation=generation,
        injected_faults=injected_faults,
    )


@functools.lru_cache(maxsize=64)
def causal_and_eye(
    width: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[width, width]` bool lower-triangular and identity masks, built once per width (read
    only: callers combine them into new tensors). `tril` opens a parallel region even for one
    small matrix, which on a busy machine waits for a second core to be scheduled (its cost:
    bench/README.md, "Masks built once per width")."""
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return causal, torch.eye(width, dtype=torch.bool, device=device)


def attention_mask(sample_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask `[rows, 1, seq, seq]` bool from `sample_ids: [rows, seq]`.

    A token attends to earlier tokens of its own sample only; padding attends to itself so
    no softmax row is empty.
    """
    seq = sample_ids.shape[-1]
    same = sample_ids[:, :, None] == sample_ids[:, None, :]
    causal, eye = causal_and_eye(seq)
    return ((same & causal) | eye)[:, None]
