"""The gradnorm_vtc_correlation guard on the real engine: a counter that reads chunk 0 of the
last micro makes the grad norm follow expected/valid tokens; the step-level counter, equal to
the loss mask on every step, gives the guard nothing to correlate.

The W2 geometry (kv-retrieval prompts of 20..245 tokens, rows of 256, 4 sequence chunks, 4 head
chunks) with one change: the reward is 1 for any leading digit. With the W2 reward a random
policy almost never answers, so at test size too few steps carry a gradient to fill the
guard's 16-step minimum; this reward gives most steps one.
"""

import json
import warnings
from pathlib import Path

from grpod.engine import Engine, EngineConfig
from grpod.engine.data.tasks import KVRetrievalTask
from grpod.engine.grpo.step import decide_step
from grpod.guards import GuardPolicy
from grpod.guards.workloads import W2_GEOMETRY

STEPS = 24


def w2_dense(tmp_path: Path, **overrides: object) -> Engine:
    path = tmp_path / "kv.jsonl"
    prompts = KVRetrievalTask().prompts_for_step(0, 128, 0)
    path.write_text(
        "".join(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n" for p in prompts)
    )
    config = dict(
        W2_GEOMETRY,
        task=str(path),
        reward="tests.guards.rewards:digit_first",
        max_new_tokens=2,
        prompts_per_step=2,
        group_size=4,
        micro_batch_rows=4,  # chunk 0 of a micro is its first row: the faulty read is never 0
        **overrides,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(EngineConfig.model_validate(config))


def run(engine: Engine, policy: GuardPolicy) -> set[str]:
    return {decide_step(engine, policy, engine.rollout()).outcome for _ in range(STEPS)}


def test_faulty_unreordered_run_reads_above_threshold(tmp_path: Path) -> None:
    engine = w2_dense(tmp_path, faults={"accounting": "last_micro_first_chunk"})
    policy = GuardPolicy({"reorder": {"enabled": False}, "halt_after_consecutive_flushes": 0})
    assert run(engine, policy) == {"flushed"}  # strict accounting flushes every faulty step
    assert policy.gradnorm_vtc_correlation is not None
    assert policy.gradnorm_vtc_correlation > 0.8


def test_healthy_run_has_no_reading(tmp_path: Path) -> None:
    engine = w2_dense(tmp_path)
    policy = GuardPolicy()
    assert run(engine, policy) == {"applied"}
    guard = policy.guards["gradnorm_vtc_correlation"]
    assert len(guard.grad_norms) >= guard.config.min_steps  # evidence enough: 16 steps or more
    assert set(guard.scale_errors.values) == {1.0}
    assert policy.gradnorm_vtc_correlation is None
