"""Where a completion stops (prompt text -> ids is `engine/data/tokenizer.py:encode_prompt`).

A completion stops at any stop token id (the tokenizer's eos and every id of the model's
`generation_config.eos_token_id`) or with the token that completes one of the `stop` strings;
the reward sees the text before the stop string, as vLLM returns it.
"""

from __future__ import annotations

from typing import Any

import torch

from grpod.engine.rollout.sampler import Rollout


def stop_token_ids(tokenizer: Any, model: torch.nn.Module) -> list[int]:
    """The tokenizer's eos and every `generation_config.eos_token_id` of the model, sorted."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(int(i) for i in ids if i is not None)


def cut_at_stop_strings(rollout: Rollout, tokenizer: Any, stops: list[str]) -> Rollout:
    """End each completion with the token whose text completes a stop string.

    Sampling is causal, so dropping the tokens after that one leaves every kept token's
    sampled distribution (and logprob) as it was.
    """
    if not stops:
        return rollout
    ids, mask = rollout.completion_ids.clone(), rollout.mask.clone()
    for row, length in enumerate(mask.sum(-1).tolist()):
        tokens = ids[row, :length].tolist()
        if not _has_stop(tokenizer.decode(tokens), stops):
            continue
        # the shortest prefix holding a stop string (containment grows with the prefix)
        low, high = 1, length
        while low < high:
            mid = (low + high) // 2
            if _has_stop(tokenizer.decode(tokens[:mid]), stops):
                high = mid
            else:
                low = mid + 1
        mask[row, low:] = False
    pad = ids.new_full((), tokenizer.pad_token_id)
    logprobs = rollout.logprobs.masked_fill(~mask, 0.0)
    return Rollout(torch.where(mask, ids, pad), logprobs, mask)


def strip_stop_strings(text: str, stops: list[str]) -> str:
    """The text before the first stop string (all of it when none occurs)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _has_stop(text: str, stops: list[str]) -> bool:
    return any(s in text for s in stops)
