"""One storage for all parameters: same model, same bits, one reduction for the guards."""

from __future__ import annotations

import pytest
import torch

from grpod.engine import Engine
from grpod.engine.model.flat import ALIGN_BYTES, flatten_parameters, move_parameters
from grpod.engine.model.policy import build_tiny_qwen2
from tests.engine.helpers import config


def test_parameters_become_aligned_views_of_one_buffer_with_ties_kept() -> None:
    model = build_tiny_qwen2(16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = {name: id(p) for name, p in model.named_parameters()}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied

    flat = flatten_parameters(model)

    assert flat is not None and flat.dim() == 1
    base = flat.data_ptr()
    for name, p in model.named_parameters():
        assert id(p) == ids[name]  # the same Parameter objects: optimizers keep working
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert (p.data_ptr() - base) % ALIGN_BYTES == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert flat.numel() >= sum(p.numel() for p in model.parameters())
    # the padding holds zeros: a sum over the buffer is the sum over the parameters
    total = sum(p.detach().double().sum() for p in model.parameters())
    assert abs(float(flat.double().sum()) - float(total)) < 1e-6


def test_mixed_dtypes_are_left_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    pointers = [p.data_ptr() for p in model.parameters()]
    assert flatten_parameters(model) is None
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_training_on_the_flat_buffer_gives_the_bits_of_separate_tensors() -> None:
    flat, separate = Engine(config()), Engine(config())
    assert flat.flat_weights is not None
    for p in separate.model.parameters():  # each parameter in its own allocation again
        p.data = p.data.clone()
    assert len({p.untyped_storage().data_ptr() for p in separate.model.parameters()}) > 1
    for _ in range(3):
        for engine in (flat, separate):
            engine.accumulate(engine.rollout())
            engine.apply()
    for (name, a), (_, b) in zip(flat.model.named_parameters(), separate.model.named_parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(flat.optimizer.state.values(), separate.optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(
            a["exp_avg_sq"], b["exp_avg_sq"]
        )


def test_a_checkpoint_round_trip_keeps_the_parameters_in_the_buffer(tmp_path) -> None:
    engine = Engine(config())
    engine.accumulate(engine.rollout())
    engine.apply()
    path = engine.save_checkpoint(tmp_path / "ckpt")
    fresh = Engine(config())
    fresh.load_checkpoint(path)
    ptr = fresh.flat_weights.untyped_storage().data_ptr()
    for a, b in zip(engine.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
        assert b.untyped_storage().data_ptr() == ptr


def test_moved_parameters_keep_their_offsets_and_train_to_the_same_bits() -> None:
    moved, kept = Engine(config()), Engine(config())
    cover = moved.flat_weights
    base = cover.data_ptr()
    offsets = [p.data_ptr() - base for p in moved.model.parameters()]
    ids = [id(p) for p in moved.model.parameters()]
    into = torch.full((cover.nbytes + 64,), 7, dtype=torch.uint8)  # a mapped region, say
    move_parameters(moved.model, into)
    assert moved.flat_weights.untyped_storage().data_ptr() == into.data_ptr()
    assert [p.data_ptr() - into.data_ptr() for p in moved.model.parameters()] == offsets
    assert [id(p) for p in moved.model.parameters()] == ids  # the optimizer's Parameters
    assert moved.model.lm_head.weight is moved.model.model.embed_tokens.weight
    for _ in range(3):
        for engine in (moved, kept):
            engine.accumulate(engine.rollout())
            engine.apply()
    assert moved.state_digest() == kept.state_digest()  # weights, AdamW state, schedule
    assert moved.flat_weights.untyped_storage().data_ptr() == into.data_ptr()


def test_parameters_that_do_not_share_one_storage_or_fit_are_not_moved() -> None:
    model = build_tiny_qwen2(16)  # not flattened: a storage per parameter
    with pytest.raises(ValueError, match="do not share one storage"):
        move_parameters(model, torch.empty(1 << 20, dtype=torch.uint8))
    flatten_parameters(model)
    with pytest.raises(ValueError, match="do not fit"):
        move_parameters(model, torch.empty(64, dtype=torch.uint8))
