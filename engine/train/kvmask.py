"""What a `lastrec` rollout cache let each query see, as the trainer's attention mask.

engine/kvcache.py says what the policy keeps; `lastrec_visible` is that as a function of
positions, and `restrict_to_cache` applies it to a trunk layout's mask (engine/train/layout.py,
with `cell_prompt_lengths`), so the trainer's
logprobs are the sampler's (tests/engine/model/test_kvdecoder.py holds the function to the
decoder's actual evictions).
"""

from __future__ import annotations

import torch

from grpod.engine.kvcache import KVCacheSpec

NO_PROMPT = 1 << 40  # the prompt length of a cell that holds no sample (it sees itself only)


def lastrec_lowest_key(
    query_pos: torch.Tensor, prompt_len: torch.Tensor, spec: KVCacheSpec
) -> torch.Tensor:
    """The lowest non-sink key position a `lastrec` query at `query_pos` sees (it sees every
    key from there up to itself, and the sinks), for sequences of `prompt_len` prompt tokens.

    A chunk ending at `end` (exclusive) keeps `length - sinks` non-sink slots, the chunk's
    own among them, so its queries see non-sinks from `end - (length - sinks)`; a decode step
    at position p is a chunk of one ending at p + 1.
    """
    window = spec.length - spec.sinks
    cap = spec.chunk_cap
    prompt_end = torch.where(
        prompt_len > spec.length,
        torch.minimum((query_pos // cap + 1) * cap, prompt_len),
        prompt_len,
    )
    end = torch.where(query_pos >= prompt_len, query_pos + 1, prompt_end)
    return end - window


def lastrec_visible(
    query_pos: torch.Tensor, key_pos: torch.Tensor, prompt_len: torch.Tensor, spec: KVCacheSpec
) -> torch.Tensor:
    """Whether a `lastrec` cache still held `key_pos` when the query at `query_pos` ran
    (broadcasting; causality is the caller's: a later key is "visible" here)."""
    lowest = lastrec_lowest_key(query_pos, prompt_len, spec)
    return (key_pos < spec.sinks) | (key_pos >= lowest)


def restrict_to_cache(
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    spec: KVCacheSpec,
) -> torch.Tensor:
    """A trunk attention mask `[rows, 1, width, width]` limited to what a `lastrec` sampler
    saw: `position_ids, prompt_len: [rows, width]` are each cell's position in its sample and
    its sample's prompt length (queries and keys of one sample share it; other pairs are
    already masked). Each query keeps itself, so no softmax row empties."""
    visible = lastrec_visible(
        position_ids[:, :, None], position_ids[:, None, :], prompt_len[:, :, None], spec
    )
    eye = torch.eye(position_ids.shape[1], dtype=torch.bool, device=position_ids.device)
    return attention_mask & (visible | eye)[:, None]


def cell_prompt_lengths(
    source: torch.Tensor,
    shape: torch.Size,
    position_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """The prompt length of each cell `shape: [rows', width]` of a trunk layout whose
    `source` maps the micro rows `position_ids, sample_ids, loss_mask: [rows, seq]` into it.
    A sample's prompt length is the position of its first trainable token (positions restart
    at 0 per sample); a cell that holds no sample gets `NO_PROMPT`."""
    positions, samples = position_ids.reshape(-1), sample_ids.reshape(-1).long() + 1
    first = torch.where(loss_mask.reshape(-1), positions, NO_PROMPT)
    prompt_len = torch.full((int(samples.max()) + 1,), NO_PROMPT, dtype=torch.long)
    prompt_len = prompt_len.scatter_reduce(0, samples, first, "amin")  # [samples + 1]
    prompt_len[0] = NO_PROMPT  # padding
    cells = shape.numel()
    cell_prompt = torch.full((cells + 1,), NO_PROMPT, dtype=torch.long)  # + the zero row
    cell_prompt[source] = prompt_len[samples]  # a shared prompt's members agree
    return cell_prompt[:cells].view(shape)
