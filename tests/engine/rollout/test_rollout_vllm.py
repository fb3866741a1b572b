"""vLLM rollouts without a vLLM: the output conversion, the weight-sync check's arithmetic and
its record in the batch. The real vLLM runs in tests/vllm (`make test-vllm`); the GPU test
here only where the `gpu` extra and a CUDA device are present."""

import importlib.util
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpod.engine import Engine, EngineConfig, EngineError, TransportBatch
from grpod.engine.rollout.rollout_vllm import sampled, to_rollout
from grpod.engine.weight_sync import ProbeScores, WeightSyncCheck, compare, probe_sequence
from tests.engine.helpers import config, hand_batch

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


def logprobs(*pairs: tuple[int, float]) -> tuple[list[int], list[float] | None]:
    """A completion as vLLM returns it (per-position {token: Logprob}, logprobs=0), read."""
    return sampled([t for t, _ in pairs], [{t: SimpleNamespace(logprob=v)} for t, v in pairs])


def test_vllm_logprobs_are_kept_as_vllm_gave_them_nan_and_inf_included() -> None:
    out = to_rollout(
        [logprobs((5, -0.5), (2, math.nan)), logprobs((7, -math.inf))],
        max_new_tokens=3,
        pad_token_id=0,
    )
    assert out.completion_ids.tolist() == [[5, 2, 0], [7, 0, 0]]
    assert out.mask.tolist() == [[True, True, False], [True, False, False]]
    assert out.logprobs[0, 0] == -0.5 and math.isnan(out.logprobs[0, 1])
    assert out.logprobs[1, 0] == -math.inf  # never replaced: the finite guard flushes it
    with pytest.raises(EngineError, match="vLLM returned no sampled logprobs"):
        to_rollout([([5], None)], max_new_tokens=2, pad_token_id=0)


def scores(
    prompt: list[float],
    cached: list[float],
    fresh: list[float] | None = None,
    *,
    ids: list[int] | None = None,
    fresh_ids: list[int] | None = None,
) -> ProbeScores:
    """The sampler's probe scores: prompt logprobs, its cached and fresh continuations."""
    ids = [4] * len(cached) if ids is None else ids
    fresh_ids = ids if fresh_ids is None else fresh_ids
    return ProbeScores(ids, prompt, cached, 0, fresh_ids, cached if fresh is None else fresh)


def test_the_check_takes_the_largest_difference_and_never_passes_a_nan() -> None:
    probe = [1, 2, 3, 4]
    trainer = torch.tensor([-1.0, -2.25])  # the first 3 probe tokens scored by the trainer
    cont = [-0.5, -0.75]
    check = compare(probe, scores([-1.0, -2.0, -3.0], cont), trainer, version=3, dtype="float32")
    assert check.max_abs_diff == pytest.approx(0.25) and check.position == 2  # the weights
    assert (check.tokens, check.version, check.dtype) == (4, 3, "float32")
    # the cached continuation against the fresh one: the prefix cache
    stale = scores([-1.0, -2.25, -3.0], cont, [-0.5, -0.25])
    check = compare(probe, stale, trainer, version=3, dtype="float32")
    assert check.max_abs_diff == pytest.approx(0.5) and check.position == 5  # continuation 1
    # another greedy token: the logits differ there, never a pass
    other = scores([-1.0, -2.25, -3.0], cont, ids=[4, 5], fresh_ids=[4, 6])
    check = compare(probe, other, trainer, version=3, dtype="float32")
    assert math.isnan(check.max_abs_diff) and check.position == 5
    nan = scores([-1.0, math.nan, -3.0], cont)
    check = compare(probe, nan, trainer, version=3, dtype="float32")
    assert math.isnan(check.max_abs_diff) and check.position == 2
    with pytest.raises(EngineError, match="the sampler scored 2 of 4 probe tokens, the trainer 2"):
        compare(probe, scores([-1.0, -2.0], cont), trainer, version=3, dtype="float32")


def test_the_probe_is_fixed_and_spans_the_vocabulary() -> None:
    probe = probe_sequence(256, 15, low=3)
    assert probe == probe_sequence(256, 15, low=3) and len(probe) == 256
    assert set(probe) == set(range(3, 15))
    with pytest.raises(EngineError, match="weight sync probe"):
        probe_sequence(1, 15)


def test_the_weight_sync_check_and_version_travel_with_the_batch(tmp_path: Path) -> None:
    check = WeightSyncCheck(7, 0.25, 12, 263, 128, "float32")
    batch = replace(
        hand_batch([([1, 3, 4], 1, 0.5), ([1, 5, 6], 1, -0.5)]), weight_version=7, weight_sync=check
    )
    batch.save(tmp_path / "b.safetensors")
    loaded = TransportBatch.load(tmp_path / "b.safetensors")
    assert loaded.weight_sync == check and loaded.weight_version == 7
    nan = replace(batch, weight_sync=replace(check, max_abs_diff=math.nan))
    nan.save(tmp_path / "nan.safetensors")
    assert math.isnan(TransportBatch.load(tmp_path / "nan.safetensors").weight_sync.max_abs_diff)
    metadata = {**batch.metadata(), "weight_sync": '{"version": 7}'}
    with pytest.raises(EngineError, match="bad metadata"):
        TransportBatch.from_tensors(batch.tensors(), metadata)
    # a one-process run records its version; a worst rank's check stands for a global batch
    worse = replace(batch, weight_sync=replace(check, max_abs_diff=math.nan))
    assert math.isnan(TransportBatch.concat([batch, worse]).weight_sync.max_abs_diff)


def test_the_torch_sampler_records_the_weight_version_and_no_check() -> None:
    engine = Engine(config())
    batch = engine.rollout()
    assert batch.weight_version == 0 and batch.weight_sync is None


def test_weight_sync_drills_need_the_vllm_backend() -> None:
    with pytest.raises(
        ValueError, match="faults weight_sync_\\*: need rollout_backend 'vllm' or 'vllm-server'"
    ):
        EngineConfig(faults={"weight_sync_skip_steps": [1]})
