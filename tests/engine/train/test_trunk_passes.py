"""Which micros share a trunk pass: decided from one scan per micro, as the full layouts would."""

from __future__ import annotations

import dataclasses

import torch

from grpod.engine import Engine, TransportBatch
from grpod.engine.train.layout import joint_slots, micro_layout, scan_units, trunk_passes
from tests.engine.helpers import W2, config, hand_batch


def _scans(batch: TransportBatch) -> list:
    return [
        scan_units(
            batch.input_ids[m], batch.position_ids[m], batch.sample_ids[m], batch.loss_mask[m]
        )
        for m in range(batch.num_micros)
    ]


def _greedy_over_full_layouts(batch: TransportBatch) -> list[list[int]]:
    """The grouping by building every candidate group's layout: all micros when they fit one
    micro's slots, else consecutive micros while their joint layout fits."""
    budget = batch.input_ids.shape[1] * batch.seq_len
    everything = list(range(batch.num_micros))
    if micro_layout(batch, everything).input_ids.numel() <= budget:
        return [everything]
    groups, micros = [], []
    for micro in everything:
        if micros and micro_layout(batch, [*micros, micro]).input_ids.numel() > budget:
            groups.append(micros)
            micros = []
        micros.append(micro)
    return [*groups, micros]


def test_pass_grouping_equals_the_greedy_over_full_layouts() -> None:
    engine = Engine(config(**{**W2, "prompts_per_step": 8, "group_size": 4}))
    split = 0
    for _ in range(4):
        batch = engine.rollout()
        passes = list(trunk_passes(batch, joint=True))
        groups = [micros for micros, _ in passes]
        assert groups == _greedy_over_full_layouts(batch)
        assert [m for group in groups for m in group] == list(range(batch.num_micros))
        for micros, layout in passes:
            expected = micro_layout(batch, micros)
            assert torch.equal(layout.input_ids, expected.input_ids)
            assert torch.equal(layout.attention_mask, expected.attention_mask)
            assert torch.equal(layout.source, expected.source)
        split += len(groups) > 1
        engine.skip(batch)
    assert split  # the budget really split some batch into several passes


def test_joint_slots_is_the_joint_layouts_size_with_every_fallback() -> None:
    prompt = [1, 5, 6, 7]
    samples = [([*prompt, 8 + i, 9, 2], 4, 1.0) for i in range(3)] + [([1, 3, 4, 9, 2], 3, -1.0)]
    batch = hand_batch(samples, seq_len=16, rows=1, pack_rows=False)  # one sample per micro
    assert batch.num_micros == 4

    def check(batch: TransportBatch) -> None:
        scans = _scans(batch)
        for a in range(batch.num_micros):
            for b in range(a, batch.num_micros):
                size = micro_layout(batch, list(range(a, b + 1))).input_ids.numel()
                assert joint_slots(scans[a : b + 1], batch.seq_len) == size

    check(batch)  # shared prompt units across micros, and a unit of its own
    assert joint_slots(_scans(batch)[:3], 16) < 3 * 16  # the shared prompt runs once

    # the same sample id in two micros is no packed batch: the joint runs as laid out
    twice = batch.sample_ids.clone()
    twice[1][twice[1] >= 0] = 0
    check(dataclasses.replace(batch, sample_ids=twice))
    assert scan_units(*_micro(batch, 1, sample_ids=twice)).units is not None  # alone: fine

    # a trainable first token (scored from outside its sample) forces the plain layout
    mask = batch.loss_mask.clone()
    mask[2][0, 0] = True
    check(dataclasses.replace(batch, loss_mask=mask))
    assert scan_units(*_micro(batch, 2, loss_mask=mask)).units is None


def _micro(batch: TransportBatch, m: int, **fields: torch.Tensor) -> tuple[torch.Tensor, ...]:
    values = {
        name: fields.get(name, getattr(batch, name))[m]
        for name in ("input_ids", "position_ids", "sample_ids", "loss_mask")
    }
    return tuple(values.values())
