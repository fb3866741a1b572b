"""Several reward functions with weights: the weighted total, each one's mean and std."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, EngineError
from grpod.engine.errors import RewardError
from grpod.engine.rewardcall import call_reward, real_value
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
        ({"rewards": ["a:b", "a:c"], "reward_weights": [1.0, math.nan]}, "must be finite"),
        ({"rewards": ["a:b"], "reward_weights": [math.inf]}, r"must be finite \(got inf\)"),
    ],
)
def test_config_refuses(engine: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**engine)


def test_any_real_scalar_is_a_number_and_nothing_else_is() -> None:
    import numpy as np

    reals = [1, 0.5, np.float32(0.25), np.float16(2), np.int64(3), np.array(1.5)]
    reals += [torch.tensor(0.75), torch.tensor(4, dtype=torch.int32)]
    assert [real_value(v) for v in reals] == [1.0, 0.5, 0.25, 2.0, 3.0, 1.5, 0.75, 4.0]
    others = [True, np.bool_(True), torch.tensor(True), 1j, np.complex64(1), "1.0", None]
    others += [[1.0], np.array([1.0]), torch.tensor([1.0]), torch.tensor(1j)]
    assert [real_value(v) for v in others] == [None] * len(others)


def test_a_reward_past_its_time_limit_is_its_failure() -> None:
    import time

    def hangs(prompt: str, completion: str, answer: str) -> float:
        try:
            time.sleep(30)
        except Exception:  # a reward's own handler does not swallow the time limit
            return 0.0
        return 1.0

    started = time.monotonic()
    with pytest.raises(RewardError, match=r"reward m:hangs took longer than .* 0.2 on sample 3"):
        call_reward(hangs, "m:hangs", "1+1=", "2", "2", where="", sample=3, timeout_seconds=0.2)
    assert time.monotonic() - started < 10  # interrupted, not slept out
    assert call_reward(lambda p, c, a: 1, "m:f", "p", "c", "a", where="", sample=0) == 1.0
