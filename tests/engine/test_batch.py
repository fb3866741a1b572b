from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpod.engine import Engine, EngineError, TransportBatch
from tests.engine.helpers import config


@pytest.fixture(scope="module")
def batch() -> TransportBatch:
    return Engine(config()).rollout()


def test_round_trip_is_bit_exact(batch: TransportBatch, tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    batch.save(path)
    back = TransportBatch.load(path)
    for name, tensor in batch.tensors().items():
        got = back.tensors()[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    provenance = ("step", "config_digest", "generation", "injected_faults", "micro_order")
    assert [getattr(back, n) for n in provenance] == [getattr(batch, n) for n in provenance]
    assert not list(tmp_path.glob(".*tmp*")), "temp file left behind"


def _rewrite(src: Path, dst: Path, edit) -> None:
    from safetensors import safe_open

    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as fh:
        meta = fh.metadata()
    edit(tensors, meta)
    save_file(tensors, str(dst), metadata=meta)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, m: t.pop("loss_mask"), "missing tensor 'loss_mask'"),
        (
            lambda t, m: t.update(advantages=t["advantages"][:, :1].contiguous()),
            "tensor 'advantages' has shape",
        ),
        (lambda t, m: t.update(input_ids=t["input_ids"].int()), "tensor 'input_ids' has dtype"),
        (
            lambda t, m: t.update(rewards=t["rewards"][:2, None].contiguous()),
            "tensor 'rewards' must be",
        ),
        (lambda t, m: m.update(format="other"), "format is 'other'"),
        (lambda t, m: m.pop("step"), "bad metadata"),
    ],
)
def test_malformed_files_are_rejected(batch, tmp_path, edit, message) -> None:
    good = tmp_path / "good.safetensors"
    batch.save(good)
    bad = tmp_path / "bad.safetensors"
    _rewrite(good, bad, edit)
    with pytest.raises(EngineError, match=message) as err:
        TransportBatch.load(bad)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_truncated_and_missing_files_are_rejected(batch, tmp_path) -> None:
    path = tmp_path / "b.safetensors"
    batch.save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(EngineError, match=r"b\.safetensors"):
        TransportBatch.load(path)
    with pytest.raises(EngineError, match="cannot read"):
        TransportBatch.load(tmp_path / "absent.safetensors")


def test_reorder_keeps_the_order_relative_to_the_rollout(batch) -> None:
    if batch.num_micros < 2:
        pytest.skip("needs two micros")
    order = list(range(batch.num_micros))[::-1]
    moved = batch.reorder(order)
    assert torch.equal(moved.input_ids[0], batch.input_ids[-1])
    assert moved.micro_order == order
    assert batch.reorder(moved.micro_order).micro_order == order
    with pytest.raises(EngineError, match="not a permutation"):
        batch.reorder([0, 0])


def test_concat_then_part_gives_each_rank_its_own_batch_back(batch) -> None:
    other = batch.reorder(list(reversed(range(batch.num_micros))))
    joined = TransportBatch.concat([batch, other])
    assert joined.rank_micros == (batch.num_micros,) * 2
    assert joined.rank_samples == (batch.num_samples,) * 2
    assert joined.num_micros == 2 * batch.num_micros
    assert joined.num_samples == 2 * batch.num_samples
    assert joined.expected_valid_tokens() == 2 * batch.expected_valid_tokens()
    second = joined.sample_ids[batch.num_micros :]
    assert int(second[second >= 0].min()) >= batch.num_samples  # renumbered, still distinct
    for rank, original in enumerate((batch, other)):
        part = joined.part(rank)
        for name, tensor in original.tensors().items():
            assert torch.equal(part.tensors()[name], tensor), name
        identity = list(range(original.num_micros))
        assert part.rank == rank
        assert (part.micro_order or identity) == (original.micro_order or identity)
    with pytest.raises(EngineError, match="holds no rank 2"):
        joined.part(2)
    with pytest.raises(EngineError, match="not distributed"):
        batch.part(0)
