"""A long-context campaign through a bounded `lastrec` rollout cache, recorded and replayed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grpod.forensics import list_incidents, replay
from grpod.forensics.step_replay import bit_equal
from tests.forensics.campaign import run_campaign

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

LONG_CONTEXT = dict(  # prompts of 40..90 tokens through a 24-slot cache: every one evicts
    task="kv-retrieval",
    kv_retrieval_records=(7, 17),
    seq_len=96,
    max_new_tokens=2,
    rollout_kv_cache="lastrec",
    kv_cache_length=24,
)


def test_a_flushed_long_context_step_replays_bit_exactly(tmp_path: Path) -> None:
    run = run_campaign(
        tmp_path / "run", 4, checkpoint_every=100, faults={"inf_grad_steps": [2]}, **LONG_CONTEXT
    )
    assert [run.outcomes[s] for s in range(4)] == ["applied", "applied", "flushed", "applied"]
    flushed = run.reports[2]
    assert math.isfinite(flushed.loss) and flushed.grad_norm == math.inf
    assert flushed.kv_cache.prompt_tokens_evicted > 0 and flushed.mismatch_max < 2e-6
    (incident,) = list_incidents(run.run_dir)
    result = replay(run.run_dir, incident_id=incident["id"])
    assert result.reproduced and result.step == 2
    assert bit_equal(float(result.replayed["loss"]), flushed.loss)
    after = replay(run.run_dir, step=3)  # the flush left the policy as it was
    assert after.reproduced and after.steps_replayed == 4
    for name in ("valid_tokens", "loss", "grad_norm"):
        assert bit_equal(after.replayed[name], getattr(run.reports[3], name))
