"""One storage for all parameters: same model, same bits, one reduction for the guards."""

from __future__ import annotations

import torch

from grpod.engine import Engine
from grpod.engine.model.flat import ALIGN_BYTES, flatten_parameters
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
