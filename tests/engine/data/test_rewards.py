"""Several reward functions with weights: the weighted total, each one's mean and std; one
call-and-check for every caller, a non-finite value as each caller's `NonFinite` says."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, EngineError
from grpod.engine.data.rewardcall import NonFinite, call_reward, real_value, reward_alarm
from grpod.engine.errors import RewardError
from grpod.engine.grpo.eval import Evaluator
from grpod.engine.grpo.preflight import preflight
from tests.engine.helpers import config

REWARDS = """\
def digit(prompt, completion, answer):
    return float(completion[:1].isdigit())
def length(prompt, completion, answer):
    return float(len(completion))
def broken(prompt, completion, answer):
    raise ValueError("nope")
def nan(prompt, completion, answer):
    return float("nan")
def inf(prompt, completion, answer):
    return float("inf")
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

    # raised at all: interrupted (a sleep slept out returns 1.0 and raises nothing)
    with pytest.raises(RewardError, match=r"reward m:hangs took longer than .* 0.2 on sample 3"):
        call(hangs, "m:hangs", sample=3, timeout_seconds=0.2)
    assert call(lambda p, c, a: 1, "m:f") == 1.0


def test_a_batch_installs_the_alarm_once_and_each_call_keeps_its_limit() -> None:
    """`reward_alarm` around many calls: the handler stays installed between them (no
    `signal.signal` per call), each call still has its own limit, an alarm between two calls
    raises nothing, and the previous handler is back after the batch."""
    import signal
    import time

    before = signal.getsignal(signal.SIGALRM)
    seen = []

    def quick(prompt: str, completion: str, answer: str) -> float:
        seen.append(signal.getsignal(signal.SIGALRM))
        return 1.0

    def hangs(prompt: str, completion: str, answer: str) -> float:
        time.sleep(30)
        return 1.0

    with reward_alarm(5.0):
        installed = signal.getsignal(signal.SIGALRM)
        assert installed is not before
        assert [call(quick, "m:q", timeout_seconds=5.0) for _ in range(3)] == [1.0] * 3
        assert seen == [installed] * 3  # the batch's handler, not one per call
        signal.setitimer(signal.ITIMER_REAL, 0.01)  # between calls: nothing raised
        while signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # until it has fired
            time.sleep(0.005)
        time.sleep(0)  # a bytecode boundary: the handler has run
        # interrupted: a 30 s sleep slept out would return 1.0 and raise nothing
        with pytest.raises(RewardError, match=r"reward m:hangs took longer than .* 0.2 "):
            call(hangs, "m:hangs", timeout_seconds=0.2)
        assert signal.getsignal(signal.SIGALRM) is installed  # still the batch's
    assert signal.getsignal(signal.SIGALRM) is before
    assert call(quick, "m:q", timeout_seconds=5.0) == 1.0  # alone: installed and removed
    assert signal.getsignal(signal.SIGALRM) is before


def call(fn, name: str, non_finite: NonFinite = NonFinite.PASS, **kw) -> float:
    kw = {"where": "", "sample": 0, **kw}
    return call_reward(fn, name, "1+1=", "2", "2", non_finite=non_finite, **kw)


def test_a_non_finite_value_is_refused_or_passed_as_its_caller_says() -> None:
    import numpy as np

    for value in (math.nan, math.inf, -math.inf, np.float32("nan"), torch.tensor(math.inf)):
        expected = float(value)
        with pytest.raises(RewardError, match=rf"reward m:f returned {expected}, not a finite"):
            call(lambda p, c, a, v=value: v, "m:f", NonFinite.REFUSE, sample=2)
        got = call(lambda p, c, a, v=value: v, "m:f", NonFinite.PASS)
        assert got == expected or (math.isnan(got) and math.isnan(expected))
    assert call(lambda p, c, a: 0.5, "m:f", NonFinite.REFUSE) == 0.5  # finite: the number
    with pytest.raises(RewardError, match="returned str, not a number"):  # either way
        call(lambda p, c, a: "1.0", "m:f", NonFinite.PASS)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_preflight_refuses_a_non_finite_reward_on_its_sample(
    rewards_module: Path, bad: str
) -> None:
    """Bad input: every `rewards` entry, and the task's own reward, on the first prompt."""
    with pytest.raises(RewardError, match=rf"reward multirewards:{bad} returned {bad}, not a"):
        preflight(config(rewards=["multirewards:digit", f"multirewards:{bad}"]))
    (rewards_module / "t.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    task = str(rewards_module / "t.jsonl")
    named = rf"task {re.escape(task)}: reward multirewards:{bad} returned {bad}, not a finite"
    with pytest.raises(RewardError, match=named):
        preflight(config(task=task, reward=f"multirewards:{bad}"))
    preflight(config(rewards=["multirewards:digit", "multirewards:length"]))  # finite: ok


def test_a_nan_reward_reaches_the_run_s_batch(rewards_module: Path) -> None:
    """The run passes it on (no RewardError): the finite guard flushes the step
    (tests/guards/test_finite.py)."""
    names = ["multirewards:digit", "multirewards:nan"]
    batch = Engine(config(rewards=names, max_new_tokens=2)).rollout()
    assert bool(batch.rewards.isnan().all()) and len(batch.rewards) == 16
    assert all(math.isnan(v) for v in batch.function_rewards["multirewards:nan"])
    assert all(v in (0.0, 1.0) for v in batch.function_rewards["multirewards:digit"])


def test_a_nan_eval_reward_makes_the_eval_mean_nan(rewards_module: Path) -> None:
    names = ["multirewards:digit", "multirewards:nan"]
    cfg = config(rewards=names, eval_task="arith", eval_samples=4, max_new_tokens=2)
    result = Evaluator(Engine(cfg)).run()
    assert result.samples == 4
    assert math.isnan(result.rewards["total"]) and math.isnan(result.rewards[names[1]])
    assert 0.0 <= result.rewards[names[0]] <= 1.0
