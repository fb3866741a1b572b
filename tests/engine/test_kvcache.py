"""Bounded rollout caches: settings, chunking, and the trainer scoring what was sampled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, TransportBatch
from grpod.engine.data.tasks import KVRetrievalTask
from grpod.engine.errors import EngineError
from grpod.engine.kvcache import KVCacheSpec, prefill_chunks
from grpod.engine.model.policy import build_tiny_qwen2
from grpod.engine.report import KVCacheReport
from grpod.engine.rollout.torch_sampler import sample
from tests.engine.helpers import config


def test_the_settings_default_and_refuse_what_cannot_work() -> None:
    assert config(rollout_kv_cache="lastrec", kv_cache_length=64).kv_cache_spec == KVCacheSpec(
        "lastrec", 64, 8
    )
    assert config(rollout_kv_cache="lastrec", kv_cache_length=512).kv_cache_spec.sinks == 16
    explicit = config(rollout_kv_cache="lastrec", kv_cache_length=64, kv_sink_tokens=0)
    assert explicit.kv_cache_spec.sinks == 0  # an explicit 0 is respected
    h2o = config(rollout_kv_cache="h2o", kv_cache_length=32, kv_grace_period=3, tis_cap=2.0)
    assert h2o.kv_cache_spec == KVCacheSpec("h2o", 32, 4, 3)
    assert config().kv_cache_spec is None
    refused = {
        r"must exceed the protected tokens \(kv_sink_tokens 4 \+ kv_grace_period 0\)": dict(
            rollout_kv_cache="lastrec", kv_cache_length=4, kv_sink_tokens=4
        ),
        r"kv_sink_tokens 2 \+ kv_grace_period 6": dict(
            rollout_kv_cache="h2o",
            kv_cache_length=8,
            kv_sink_tokens=2,
            kv_grace_period=6,
            tis_cap=2.0,
        ),
        r"needs tis_cap > 0": dict(rollout_kv_cache="h2o"),
        "kv_grace_period is an h2o setting": dict(rollout_kv_cache="lastrec", kv_grace_period=2),
        "needs rollout_backend = 'torch'": dict(rollout_kv_cache="lastrec", rollout_decoder="hf"),
        r"kv_retrieval_records \[5, 4\]": dict(kv_retrieval_records=(5, 4)),
        "make prompts of 1005 tokens: seq_len 256": dict(
            task="kv-retrieval", seq_len=256, kv_retrieval_records=(40, 200)
        ),
    }
    for message, settings in refused.items():
        with pytest.raises(ValidationError, match=message):
            config(**settings)


def test_prefill_chunks_cover_the_prompt_within_the_cap() -> None:
    spec = KVCacheSpec("lastrec", 16, 2)
    assert prefill_chunks(16, spec) == [(0, 16)]  # fits: one chunk, nothing evicted
    assert prefill_chunks(40, spec) == [(0, 14), (14, 14), (28, 12)]
    assert max(size for _, size in prefill_chunks(100, KVCacheSpec("h2o", 16, 2, 5))) == 9
    with pytest.raises(EngineError, match="no slot beside the 8 protected"):
        KVCacheSpec("h2o", 8, 4, grace=4)
    with pytest.raises(EngineError, match="grace period is an h2o setting"):
        KVCacheSpec("lastrec", 8, 1, grace=2)
    assert KVCacheSpec.from_json(spec.to_json()) == spec
    with pytest.raises(EngineError, match="KVCacheSpec"):
        KVCacheSpec.from_json('{"policy": "lastrec"}')


def test_the_hugging_face_decoder_refuses_a_bounded_cache() -> None:
    with pytest.raises(EngineError, match="the Hugging Face decoder cannot evict"):
        sample(
            build_tiny_qwen2(15),
            [[1, 4, 5]],
            max_new_tokens=2,
            temperature=1.0,
            top_p=1.0,
            eos_token_id=2,
            pad_token_id=0,
            generator=torch.Generator().manual_seed(0),
            decoder="hf",
            kv_cache=KVCacheSpec("lastrec", 8, 1),
        )


def test_kv_retrieval_draws_its_record_range_and_asks_early_or_late() -> None:
    for asked in ("early", "late"):
        task = KVRetrievalTask(records=(40, 200), asked=asked)
        prompts = task.prompts_for_step(0, 64, seed=0)
        counts = [p.text.count(";") for p in prompts]
        assert min(counts) >= 40 and max(counts) <= 200 and max(counts) > 150
        for p in prompts:
            body, key = p.text[:-1].split("?")
            records = body.rstrip(";").split(";")
            index = [r.split(":")[0] for r in records].index(key)
            quarter = len(records) // 4
            assert index < quarter if asked == "early" else index >= len(records) - quarter
            assert records[index].split(":")[1] == p.answer
    # the default range is W2's; a long batch draws from 30 records up within the range
    long = KVRetrievalTask(long_batch_fraction=1.0, records=(10, 35)).prompts_for_step(0, 32, 0)
    assert {p.text.count(";") for p in long} <= set(range(30, 36))
    counts = {p.text.count(";") for p in KVRetrievalTask().prompts_for_step(0, 64, seed=0)}
    assert min(counts) >= 4 and max(counts) <= 48 and min(counts) < 30


LONG = dict(  # prompts of 50..110 tokens through a 24-slot cache (3 sinks by default)
    task="kv-retrieval",
    kv_retrieval_records=(9, 21),
    seq_len=120,
    prompts_per_step=4,
    group_size=2,
    micro_batch_rows=4,
    max_new_tokens=3,
    kv_cache_length=24,
)


def test_the_lastrec_trainer_scores_what_the_sampler_saw() -> None:
    engine = Engine(config(**LONG, rollout_kv_cache="lastrec"))
    batch = engine.rollout()
    assert batch.kv_cache == KVCacheSpec("lastrec", 24, 3)
    report = engine.accumulate(batch)
    engine.flush()
    assert report.mismatch_max < 2e-6  # FP32 rounding: the trainer masks what was evicted
    assert report.kv_cache == KVCacheReport(
        "lastrec", 24, 3, 0, report.kv_cache.prompt_tokens_evicted, 1.0
    )
    lengths = [int(n) for n in batch.completion_lengths]
    assert report.kv_cache.prompt_tokens_evicted > 20 * len(lengths)  # every prompt > 49 tokens
    # the same batch under a dense trainer differs from the sampler; scoring agrees too
    dense = Engine(config(**LONG))
    assert dense.accumulate(replace(batch, kv_cache=None)).mismatch_max > 1e-2
    dense.flush()
    scored = engine.score(batch)[batch.loss_mask]
    assert (scored - batch.sampler_logprobs[batch.loss_mask]).abs().max() < 2e-6
    # the setting travels with the batch: a saved batch is trained the same way
    assert TransportBatch.from_tensors(batch.tensors(), batch.metadata()).kv_cache == batch.kv_cache


def test_h2o_trains_with_full_attention_and_corrects_by_importance_sampling() -> None:
    engine = Engine(config(**LONG, rollout_kv_cache="h2o", kv_grace_period=2, tis_cap=2.0))
    batch = engine.rollout()
    report = engine.accumulate(batch)
    engine.flush()
    assert (report.kv_cache.policy, report.kv_cache.grace_period) == ("h2o", 2)
    dense = Engine(config(**LONG, tis_cap=2.0))
    twin = dense.accumulate(replace(batch, kv_cache=None))
    dense.flush()
    assert report.mismatch_max == twin.mismatch_max > 1e-2  # full attention, watched


def test_a_bad_kv_cache_setting_in_a_batch_is_refused_naming_it() -> None:
    batch = Engine(config(**LONG, rollout_kv_cache="lastrec")).rollout()
    metadata = {**batch.metadata(), "kv_cache": '{"policy": "lastrec", "length": 4, "sinks": 4}'}
    with pytest.raises(EngineError, match="batch b: bad metadata: kv cache: length 4 leaves"):
        TransportBatch.from_tensors(batch.tensors(), metadata, source="b")
