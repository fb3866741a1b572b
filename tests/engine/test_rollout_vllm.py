"""vLLM rollouts: run only where the `gpu` extra and a CUDA device are present."""

import importlib.util

import pytest
import torch

from grpod.engine import Engine, EngineError
from tests.engine.helpers import config

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (gpu extra) and a CUDA device")
def test_vllm_rollout_agrees_with_the_trainer() -> None:
    engine = Engine(config(rollout_backend="vllm", device="cuda", prompts_per_step=8))
    batch = engine.rollout()
    assert batch.num_samples == 8 * 4
    report = engine.accumulate(batch)
    assert report.valid_tokens == report.expected_valid_tokens
    # vLLM (bf16/fp32 kernels) vs the trainer's FP32 head: close, not bit-equal
    assert report.mismatch_p99 < 0.05
    engine.apply()
    assert engine.rollout().step == 1  # weights re-synced before the next rollout


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here")
def test_vllm_backend_without_the_extra_is_a_clear_error() -> None:
    engine = Engine(config(rollout_backend="vllm"))
    with pytest.raises(EngineError, match="rollout_backend vllm: "):
        engine.rollout()
