"""A `TransportBatch` built by hand, shared by the tests of every package that reads batches."""

from __future__ import annotations

from typing import Any

import torch

from grpod.engine import TransportBatch


def make_batch(**fields: Any) -> TransportBatch:
    """A batch of one group (every `group_ids` and `sample_group_ids` 0), digest "test",
    step 0 and no sampler logprobs unless `fields` say otherwise; `fields` give the rest
    (`loss_mask: [micros, rows, seq]` its shape, `rewards: [samples]` the count)."""
    one_group = {
        "group_ids": torch.zeros(fields["loss_mask"].shape, dtype=torch.int32),
        "sample_group_ids": torch.zeros(len(fields["rewards"]), dtype=torch.int32),
    }
    defaults = {"step": 0, "sampler_logprobs": None, "config_digest": "test"}
    return TransportBatch(**{**defaults, **one_group, **fields})
