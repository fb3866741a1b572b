"""The step-level valid-token counter on W2 batches (prompts longer than one chunk)."""

import pytest

from grpod.engine import Engine
from tests.engine.helpers import W2, config


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("long_fraction", [0.0, 1.0])
def test_counter_equals_mask_sum(order: str, pack: bool, long_fraction: float) -> None:
    engine = Engine(
        config(**W2, chunk_order=order, pack=pack, long_prompt_batch_fraction=long_fraction)
    )
    for _ in range(2):
        batch = engine.rollout()
        report = engine.accumulate(batch)
        assert report.valid_tokens == report.expected_valid_tokens == int(batch.loss_mask.sum())
        assert sum(c.valid_tokens for c in report.chunk_trace) == report.valid_tokens
        assert len(report.chunk_trace) == batch.num_micros * batch.sequence_chunks
        counts = batch.chunk_valid_counts()
        for c in report.chunk_trace:
            assert c.valid_tokens == int(counts[c.micro, c.chunk])
        engine.flush()
    if long_fraction == 1.0:
        assert int(batch.chunk_valid_counts()[:, 0].sum()) == 0  # every chunk 0 is all prompt


def test_fault_reads_chunk_zero_of_the_last_micro() -> None:
    engine = Engine(config(**W2, faults={"accounting": "last_micro_first_chunk"}))
    seen_zero = seen_nonzero = False
    for _ in range(6):
        batch = engine.rollout()
        report = engine.accumulate(batch)
        last_chunk0 = int(batch.chunk_valid_counts()[-1, 0])
        assert report.valid_tokens == last_chunk0
        assert report.valid_tokens < report.expected_valid_tokens
        assert (
            report.chunk_trace[-1].chunk == 0
            and report.chunk_trace[-1].micro == batch.num_micros - 1
        )
        seen_zero |= last_chunk0 == 0
        seen_nonzero |= last_chunk0 > 0
        engine.flush()
    assert seen_zero, "the drill workload should produce vtc=0 steps"


def test_fault_on_all_long_batches_reads_zero_and_explodes_the_scale() -> None:
    healthy = Engine(config(**W2, long_prompt_batch_fraction=1.0))
    faulty = Engine(
        config(
            **W2, long_prompt_batch_fraction=1.0, faults={"accounting": "last_micro_first_chunk"}
        )
    )
    batch = healthy.rollout()
    good = healthy.accumulate(batch)
    bad = faulty.accumulate(batch)
    assert bad.valid_tokens == 0 and good.valid_tokens == bad.expected_valid_tokens > 0
    # the loss and gradient are scaled by 1/max(counter, 1) instead of 1/step total
    assert bad.loss == pytest.approx(good.loss * good.valid_tokens, rel=1e-4, abs=1e-6)
    assert bad.grad_norm == pytest.approx(good.grad_norm * good.valid_tokens, rel=1e-3)
    healthy.flush()
    faulty.flush()
