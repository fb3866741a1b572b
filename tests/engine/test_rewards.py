"""Several reward functions with weights: the weighted total, each one's mean and std."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, EngineError
from tests.engine.helpers import config

REWARDS = """\
def digit(prompt, completion, answer):
    return float(completion[:1].isdigit())
def length(prompt, completion, answer):
    return float(len(completion))
def broken(prompt, completion, answer):
    raise ValueError("nope")
"""


@pytest.fixture
def rewards_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "multirewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_weighted_total_and_per_function_stats(rewards_module: Path) -> None:
    names = ["multirewards:digit", "multirewards:length"]
    engine = Engine(config(rewards=names, reward_weights=[1.0, 0.25], max_new_tokens=4))
    batch = engine.rollout()
    parts = batch.function_rewards
    assert sorted(parts) == sorted(names) and all(len(v) == 16 for v in parts.values())
    expected = torch.tensor(parts[names[0]]) + 0.25 * torch.tensor(parts[names[1]])
    assert torch.allclose(batch.rewards, expected.float())
    report = engine.accumulate(batch)
    engine.apply()
    for name in names:
        values = torch.tensor(parts[name], dtype=torch.float64)
        assert report.reward_functions[name]["mean"] == pytest.approx(float(values.mean()))
        assert report.reward_functions[name]["std"] == pytest.approx(
            float(values.std(correction=0))
        )
    assert report.reward_mean == pytest.approx(float(expected.mean()), rel=1e-6)
    assert Engine(config()).rollout().function_rewards == {}  # one reward: no parts


def test_a_failing_function_is_named(rewards_module: Path) -> None:
    engine = Engine(config(rewards=["multirewards:digit", "multirewards:broken"]))
    with pytest.raises(EngineError, match=r"multirewards:broken raised on sample 0 .*nope"):
        engine.rollout()


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"rewards": ["a:b"], "reward_weights": [1.0, 2.0]}, "reward_weights has 2 entries"),
        ({"rewards": ["a:b"], "reward": "a:c"}, "give reward or rewards, not both"),
        ({"rewards": ["a:b", "a:b"]}, "rewards lists a function twice"),
        ({"system_prompt": "x"}, "system_prompt needs prompt_format = 'chat'"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"eval_every": 5}, "eval_every needs an eval_task"),
        ({"eval_task": "nope"}, "eval_task must be one of"),
    ],
)
def test_config_refuses(engine: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**engine)
