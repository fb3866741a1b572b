"""Checkpoints of Stateful objects: the engine's data cursor (with its rollout cache) included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpod.engine import Engine, EngineError
from grpod.engine.model.parallel import Parallel
from grpod.engine.state import distcp
from grpod.engine.state.checkpoint import load_checkpoint, save_checkpoint
from tests.engine.helpers import config


def test_the_cursor_and_its_rollout_cache_travel_in_a_checkpoint(tmp_path: Path) -> None:
    cfg = config(prompts_per_step=2, group_size=4, epochs=2)
    first = Engine(cfg)
    first.accumulate(first.rollout())
    first.apply()  # generation 0's batch is cached for its second epoch
    path = save_checkpoint(tmp_path / "ck", {"engine": first}, extra={"note": "x"})
    assert (path / "cursor.safetensors").is_file()
    resumed = Engine(cfg)
    assert load_checkpoint(path, {"engine": resumed}) == {"note": "x"}
    assert resumed.step == 1 and resumed.state_digest() == first.state_digest()
    a, b = first.rollout(), resumed.rollout()  # epoch 2 of generation 0, from the cache
    assert all(torch.equal(t, b.tensors()[n]) for n, t in a.tensors().items())
    assert a.old_logprobs is not None and torch.equal(a.old_logprobs, b.old_logprobs)


def test_a_pending_step_or_a_missing_state_is_refused(tmp_path: Path) -> None:
    engine = Engine(config(prompts_per_step=2, group_size=4))
    engine.accumulate(engine.rollout())
    with pytest.raises(EngineError, match="still pending"):
        save_checkpoint(tmp_path / "ck", {"engine": engine})
    assert not (tmp_path / "ck").exists()
    engine.flush()
    save_checkpoint(tmp_path / "ck", {"engine": engine})
    with pytest.raises(EngineError, match="holds no guards state"):
        load_checkpoint(tmp_path / "ck", {"engine": engine, "guards": engine})


def test_replicas_under_torchrun_checkpoint_rank_0s_state_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # parallel = "none" under torchrun: a replica per rank, one run dir, no process group.
    # Two writers of one checkpoint directory raced (a step failed with "Directory not
    # empty" in the two-node test), and the last one's state won. A replica is a job of its
    # own (its Parallel says rank 0 of 1), so torchrun's RANK decides who writes.
    cfg = config(prompts_per_step=2, group_size=4, parallel="none")
    engine = Engine(cfg)
    where = tmp_path / "step-00000001"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    replica = Parallel.start(cfg)
    assert (replica.mode, replica.rank, replica.world_size) == ("none", 0, 1)
    peer = distcp.save(where, {"engine": engine}, replica)
    assert peer == where and not where.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("RANK", "0")
    distcp.save(where, {"engine": engine}, Parallel.start(cfg))
    monkeypatch.setenv("RANK", "1")
    resumed = Engine(cfg)
    distcp.load(where, {"engine": resumed}, Parallel.start(cfg))
    assert resumed.state_digest() == engine.state_digest()
