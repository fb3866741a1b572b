"""Steps whose prompts overflow one vLLM scheduler step on CPU (W2's long kv-retrieval
prompts), colocated and as a server.

vLLM's CPU token budget per scheduler step is 4,096 tokens for `LLM` and 2,048 for its
OpenAI server. With chunked prefill on, the request that crosses the budget is prefilled
in part, and vLLM rewinds that request's seeded generator (`set_offset`), which a CPU
generator does not have: the engine core dies ("CPU Generator does not use offset"), and
with it every W2 step on a CPU server. grpod turns chunked prefill off on CPU.
"""

from __future__ import annotations

import pytest

from grpod.engine import Engine
from grpod.engine.grpo.step import decide_step
from grpod.engine.verdict import Outcome
from grpod.guards.policy import GuardPolicy
from tests.engine.helpers import config

FLOAT32_LIMIT = 1e-4  # nats: the weight-sync check's float32 bound (tests/vllm/test_colocated)


@pytest.mark.parametrize(
    ("backend", "prompts", "budget"),
    [("vllm-server", 4, 2048), ("vllm", 8, 4096)],  # vLLM's CPU budgets: server, LLM class
)
def test_prompts_over_a_scheduler_steps_budget_sample_and_train(
    backend: str, prompts: int, budget: int
) -> None:
    engine = Engine(
        config(
            rollout_backend=backend,
            task="kv-retrieval",
            kv_retrieval_records=(44, 48),  # prompts of 225-245 tokens
            prompts_per_step=prompts,
            group_size=4,
            micro_batch_rows=4,
            max_new_tokens=2,
            seq_len=256,
            sequence_chunks=4,
        )
    )
    policy = GuardPolicy()
    try:
        for _ in range(2):
            batch = engine.rollout()
            tokens = int((batch.sample_ids >= 0).sum())  # every sample's prompt + completion
            prompt_tokens = tokens - int(batch.completion_lengths.sum())
            assert prompt_tokens > budget, prompt_tokens  # the step overflows the budget
            assert batch.weight_sync is not None
            assert batch.weight_sync.max_abs_diff <= FLOAT32_LIMIT, batch.weight_sync
            result = decide_step(engine, policy, batch)
            assert result.outcome == Outcome.APPLIED, result.verdict
            assert result.report.mismatch_p99 is not None
            assert result.report.mismatch_p99 <= FLOAT32_LIMIT, result.report.mismatch_p99
        assert engine.weight_version == 2
    finally:
        engine.close()
