"""Async steps (`max_staleness`, engine/rollout/ahead.py): the window's staleness accounting by
weight version, the drop of a too-old batch, the refusals, and with a vllm-server (a stand-in
HTTP server here, the `stand_in` fixture of test_rollout_server.py; the real one in
tests/vllm) rollouts that sample on a background thread
while the trainer trains, pushed only once the sampler is idle."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, EngineError
from grpod.engine.config import FaultsConfig, check_parallel
from grpod.engine.errors import SamplerError
from grpod.engine.faults import Faults
from grpod.engine.grpo.trainer import step_seed
from grpod.engine.rollout.ahead import Dropped
from grpod.forensics.blobs import canonical_digest
from tests.engine.helpers import config
from tests.engine.rollout.test_rollout_server import healthy, server_config

ASYNC = dict(max_staleness=1, tis_cap=2.0)


def digest(batch) -> str:
    return canonical_digest(batch.tensors(), batch.metadata())


def same_tensors(a, b) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def train(engine: Engine, flush: bool = False):
    batch = engine.rollout()
    report = engine.accumulate(batch)
    engine.flush() if flush else engine.apply()
    return batch, report


def test_each_batch_is_at_most_k_versions_behind_and_a_flush_costs_none() -> None:
    engine = Engine(config(**{**ASYNC, "max_staleness": 2}))
    seen = []
    for step in range(6):
        batch, report = train(engine, flush=step == 2)
        assert report.staleness == batch.staleness
        seen.append((batch.weight_version, batch.staleness))
    # steps 0-2 sample from the initial weights (launched at step 0); step 2 is flushed: no
    # update, so the rollouts in flight lose nothing (accounted by version, not by step):
    # steps 3 and 4 are a version fresher than k, step 5 (launched after the flush) is k
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 1), (2, 1), (2, 2)], seen
    assert engine.take_ahead_stats().dropped == ()


def test_async_rollouts_are_reproducible_and_on_policy_steps_unchanged() -> None:
    digests = []
    for _ in range(2):
        engine = Engine(config(**ASYNC))
        digests.append([digest(train(engine)[0]) for _ in range(3)])
    assert digests[0] == digests[1]
    on_policy = Engine(config(tis_cap=2.0))
    batch, _ = train(on_policy)
    assert batch.staleness is None and batch.weight_version == 0
    assert "staleness" not in batch.metadata()  # on-policy digests as before
    first_async = train(Engine(config(**ASYNC)))[0]
    assert same_tensors(batch, first_async)  # step 0 samples the same weights either way


def test_a_batch_older_than_k_is_dropped_and_its_step_sampled_again() -> None:
    engine = Engine(config(**ASYNC, faults={"stale_rollout_steps": [2]}))
    reference = Engine(config(**ASYNC))
    for step in range(3):
        batch, _ = train(engine)
        expected, _ = train(reference)
        stats = engine.take_ahead_stats()
        if step < 2:
            assert stats.dropped == () and same_tensors(batch, expected)
    # launched at step 0 (version 0), its step came at version 2: dropped, sampled again
    assert stats.dropped == (Dropped(2, 0, 2, "stale"),)
    assert (batch.weight_version, batch.staleness) == (2, 0)
    prompts = [p for p, _ in batch.sample_tokens()]
    assert prompts == [p for p, _ in expected.sample_tokens()]  # the step's own prompts
    assert "stale-rollout" in batch.injected_faults


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_staleness": 1}, "needs importance correction (tis_cap > 0)"),
        ({**ASYNC, "epochs": 2}, "max_staleness > 0 with epochs > 1"),
        ({"faults": {"stale_rollout_steps": [1]}}, "stale_rollout_steps: needs max_staleness"),
        ({"max_staleness": 9, "tis_cap": 2.0}, "less than or equal to 8"),
    ],
)
def test_async_settings_are_checked_in_the_config(overrides: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        config(**overrides)


def test_a_node_server_is_refused_where_it_would_not_serve_one_job_per_node(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")  # under torchrun
    server = {**ASYNC, "rollout_backend": "vllm-server"}
    assert check_parallel(config(**server), world=2) == "fsdp2"
    assert check_parallel(config(**server, parallel="ddp"), world=2) == "ddp"
    with pytest.raises(EngineError, match="serves a node of one data-parallel job"):
        check_parallel(config(**server, parallel="none"), world=2)
    named = config(**server, vllm_server_url="http://10.0.0.1:8000")
    assert check_parallel(named, world=2) == "fsdp2"  # one node: its ranks share the one named
    with pytest.raises(EngineError, match="vllm_server_url: one server per node"):
        check_parallel(named, world=2, per_node=1)  # the agent's check of a 2-node job
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of that job: torchrun's environment
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(EngineError, match="vllm_server_url: one server per node"):
        check_parallel(named)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert check_parallel(named) == "fsdp2"


class Gate:
    """A stand-in server's answers, holding the completions of one step's rollout (not its
    probe) until released; every request's route and kind, in arrival order."""

    def __init__(self, held_seed: int, samples: int) -> None:
        self.held = range(held_seed, held_seed + samples)
        self.release = threading.Event()
        self.log: list[str] = []
        self.logged = threading.Condition()  # notified with every request logged
        self.fail = False

    def answer(self, route: str, body: dict[str, Any]):
        held = not body.get("ignore_eos") and body.get("seed") in self.held
        with self.logged:
            self.log.append(f"{route}:held" if held and route == "/v1/completions" else route)
            self.logged.notify_all()
        if held and route == "/v1/completions":
            self.release.wait(60)
            if self.fail:
                return 503, json.dumps({"error": {"message": "EngineCore died"}}).encode()
        return healthy(route, body)

    def held_arrived(self, count: int, timeout: float = 120.0) -> int:
        """How many held completions have arrived, once `count` have (or `timeout` passed):
        the rollout in flight sends them from its own thread, on its own schedule."""
        with self.logged:
            self.logged.wait_for(lambda: self.log.count("/v1/completions:held") >= count, timeout)
            return self.log.count("/v1/completions:held")


def async_engine(url: str, tmp_path: Path) -> Engine:
    """An async engine on a stand-in server. Its client waits as long as a gate may hold a
    step's completions: the stand-in's 0.5 s, meant for a server that never answers, timed
    out a held rollout while step 0 trained on a loaded machine (2026-12-06)."""
    return Engine(server_config(url, tmp_path, vllm_server_timeout_seconds=120.0, **ASYNC))


def test_server_rollouts_sample_while_the_trainer_trains(stand_in, tmp_path: Path) -> None:
    samples = 2 * 2
    gate = Gate(step_seed(0, 1), samples)
    server = stand_in(gate.answer)
    engine = async_engine(server.url, tmp_path)
    batch, _ = train(engine)  # step 0 trains while step 1's completions are held
    assert batch.staleness == 0 and gate.held_arrived(samples) == samples
    # step 1 was pushed and checked at launch, once step 0's rollout was done
    pushes = [i for i, r in enumerate(gate.log) if r == "/collective_rpc"]
    step0 = [i for i, r in enumerate(gate.log[: pushes[1]]) if r == "/v1/completions"]
    assert len(pushes) == 2 and len(step0) == 2 + samples  # the probe's two and step 0's
    gate.release.set()
    batch, _ = train(engine)
    assert (batch.step, batch.weight_version, batch.staleness) == (1, 0, 1)
    assert batch.weight_sync is not None and batch.weight_sync.version == 0
    stats = engine.take_ahead_stats()
    assert stats.overlap_seconds > 0.0  # step 1 sampled while step 0 trained
    engine.close()


def test_a_sampler_failure_in_flight_is_its_steps_with_the_prompts(
    stand_in, tmp_path: Path
) -> None:
    gate = Gate(step_seed(0, 1), 4)
    gate.fail = True
    server = stand_in(gate.answer)
    engine = async_engine(server.url, tmp_path)
    train(engine)
    gate.release.set()
    with pytest.raises(SamplerError, match="answered HTTP 503: EngineCore died") as caught:
        engine.rollout()
    batch = caught.value.batch
    assert batch.step == 1 and batch.num_samples == 4 and int(batch.loss_mask.sum()) == 0
    engine.close()


def test_an_eval_waits_for_the_rollout_in_flight_before_it_pushes(stand_in, tmp_path: Path) -> None:
    gate = Gate(step_seed(0, 1), 4)
    server = stand_in(gate.answer)
    engine = async_engine(server.url, tmp_path)
    train(engine)
    threading.Timer(0.2, gate.release.set).start()  # any delay: the order is what is checked
    engine.sampling.generate([[3, 4]], seed=1)
    held = max(i for i, r in enumerate(gate.log) if r == "/v1/completions:held")
    last_push = max(i for i, r in enumerate(gate.log) if r == "/collective_rpc")
    assert last_push > held  # never a push under a rollout in flight
    engine.close()


def test_the_stale_rollout_drill_fires_on_every_rank_whatever_its_ranks() -> None:
    # a launch is collective under torchrun (a node's server): one rank's early launch would
    # leave its peers waiting in a push they never make
    drill = FaultsConfig(stale_rollout_steps=[2], nan_loss_steps=[3], ranks=[1])
    assert Faults(drill, rank=0).early_rollout(2) and Faults(drill, rank=1).early_rollout(2)
    assert not Faults(drill, rank=0).injected(3) and Faults(drill, rank=1).injected(3)
