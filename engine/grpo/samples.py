"""A batch's samples as text, for people: the step log, `grpod incidents show` and export.

Decoded from the recorded `TransportBatch` itself (its token ids, rewards and per-function
rewards), with the run's tokenizer, so what is shown is what was trained on.
"""

from __future__ import annotations

from typing import Any

from grpod.engine.batch import TransportBatch
from grpod.engine.config import EngineConfig
from grpod.engine.data.tasks import task_chars
from grpod.engine.model.policy import load_tokenizer
from grpod.engine.rollout.stop_strings import strip_stop_strings


def decode_samples(
    batch: TransportBatch, tokenizer: Any, stops: list[str], limit: int | None = None
) -> list[dict[str, Any]]:
    """The first `limit` samples (all when None): {sample, group, prompt, completion, reward,
    rewards, audits}; `completion` is the text the rewards saw (cut before a stop string)."""
    rewards = batch.rewards.tolist()
    parts = batch.function_rewards
    groups = batch.sample_group_ids.tolist()
    out = []
    for i, (prompt, completion) in enumerate(batch.sample_tokens()[:limit]):
        out.append(
            {
                "sample": i,
                "group": groups[i],
                "prompt": tokenizer.decode_prompt(prompt),
                "completion": strip_stop_strings(tokenizer.decode(completion), stops),
                "reward": rewards[i],
                "rewards": {name: values[i] for name, values in parts.items()},
                "audits": {name: values[i] for name, values in batch.audit_rewards.items()},
            }
        )
    return out


def run_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer a run with `config` trained with (the built-in one needs the task's
    characters; no reward is imported and no weights are loaded)."""
    chars = task_chars(config.task) if config.model == "tiny-qwen2" else ""
    return load_tokenizer(config.model, chars)
