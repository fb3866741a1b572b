import json
from functools import partial
from pathlib import Path

import pytest

from grpod.engine import Engine, EngineError
from grpod.engine.data.rewardcall import NonFinite
from grpod.engine.data.tasks import ArithTask, CopyTask, KVRetrievalTask, build_task
from grpod.engine.data.tokenizer import CharTokenizer
from tests.engine.helpers import config


def test_w1_prompts_and_rewards() -> None:
    task = ArithTask()
    assert len(task.prompts) == 512
    p = task.prompts[0]
    a, b = int(p.text[0]), int(p.text[2])
    assert p.answer == str((a + b) % 10)
    score = partial(task.score, non_finite=NonFinite.PASS)
    assert score(p, p.answer + "12", 0) == 1.0 and score(p, "", 0) == 0.0
    assert CharTokenizer(task.chars).vocab_size == 15
    copy = CopyTask()
    assert all(q.answer == q.text[0] for q in copy.prompts)


def test_prompts_per_step_are_a_deterministic_cursor() -> None:
    task = ArithTask()
    assert task.prompts_for_step(3, 16, 0) == task.prompts_for_step(3, 16, 0)
    epoch = [p for s in range(32) for p in task.prompts_for_step(s, 16, 0)]
    assert sorted(map(id, epoch)) == sorted(map(id, task.prompts))  # one epoch = every prompt


def test_kv_long_batches_exceed_one_chunk() -> None:
    task = KVRetrievalTask(long_batch_fraction=1.0)
    assert all(len(p.text) > 150 for p in task.prompts_for_step(0, 8, 0))
    p = task.prompts_for_step(1, 1, 0)[0]
    key = p.text.split("?")[1].rstrip("=")
    assert f"{key}:{p.answer};" in p.text


def test_jsonl_task_with_a_user_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "t.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}?", "answer": str(i)}) for i in range(10)))
    (tmp_path / "myreward.py").write_text(
        "def reward(prompt, completion, answer):\n    return float(completion[:1] == answer)\n"
        "def broken(prompt, completion, answer):\n    raise RuntimeError('boom')\n"
        "def text(prompt, completion, answer):\n    return 'yes'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(config(task=str(data), reward="myreward:reward"))
    assert engine.rollout().num_samples == 16
    with pytest.raises(
        EngineError, match=r"t.jsonl: reward myreward:broken raised on sample 0 .*boom"
    ):
        Engine(config(task=str(data), reward="myreward:broken")).rollout()
    with pytest.raises(
        EngineError, match=r"reward myreward:text returned str, not a number, on sample 0"
    ):
        Engine(config(task=str(data), reward="myreward:text")).rollout()
    with pytest.raises(EngineError, match="cannot import"):
        build_task(str(data), "nosuchmodule:reward")


def test_bad_jsonl_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1"}\n')
    with pytest.raises(EngineError, match="line 1"):
        build_task(str(bad))
    with pytest.raises(EngineError, match="cannot read"):
        build_task(str(tmp_path / "missing.jsonl"))
