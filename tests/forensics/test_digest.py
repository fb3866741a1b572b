"""A transport batch's content address depends on its content alone, never on wall-clock time."""

from __future__ import annotations

from grpod.engine import Engine, TransportBatch
from grpod.forensics import canonical_digest
from tests.engine.helpers import config


def digest(batch: TransportBatch) -> str:
    return canonical_digest(batch.tensors(), batch.metadata())


def test_the_same_step_rolled_out_twice_has_one_digest() -> None:
    # epochs 2: the first rollout of a generation also runs the timed scoring pass
    cfg = config(prompts_per_step=2, group_size=4, epochs=2)
    first, second = Engine(cfg), Engine(cfg)
    digests = []
    for _ in range(2):  # the generation's rollout, then its second epoch from the cursor
        a, b = first.rollout(), second.rollout()
        assert a is not b and digest(a) == digest(b)
        digests.append(digest(a))
        first.skip(a), second.skip(b)
    assert digests[0] != digests[1]  # same samples, another step
    assert (
        digest(Engine(config(prompts_per_step=2, group_size=4, epochs=2, seed=1)).rollout())
        != (digests[0])
    )
