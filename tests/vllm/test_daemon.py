"""`grpod run` with `rollout_backend = "vllm"` as a user runs it: an own Hugging Face model
(head dim 32, BPE tokenizer, chat template, a long system prompt), SIGTERM, resume, the
weight-sync drills recorded as incidents, and `grpod replay` of vLLM-sampled steps."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.daemon.helpers import Grpod, cli, write_config
from tests.daemon.ownmodel import ENGINE, PROMPTS
from tests.hfdir import build_hf_dir

# the main environment, without vLLM (`make test-vllm` builds it first): replay needs none
MAIN_GRPOD = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "grpod"
DRILLS = {8: "sync-skip", 10: "sync-stale-cache", 12: "sync-corrupt"}
SYSTEM = "You are a careful assistant. Answer with the digit only. " * 6  # > one KV block
# a random-init model never gets the digit right: a reward with variance makes it learn
REWARD_MODULE = """
def parity(prompt, completion, answer):
    return float(sum(map(ord, completion)) % 2)
"""


def campaign(work: Path, model: Path) -> Path:
    (work / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (work / "myrewards.py").write_text(REWARD_MODULE)
    engine: dict[str, Any] = {
        **ENGINE,
        "model": str(model),
        "reward": "myrewards:parity",
        "group_size": 4,
        "rollout_backend": "vllm",
        "prompt_format": "chat",
        "system_prompt": SYSTEM,
        "seq_len": 448,
        "prompts_per_step": 4,
        "faults": {
            "weight_sync_skip_steps": [8],
            "weight_sync_stale_cache_steps": [10],
            "weight_sync_corrupt_steps": [12],
        },
    }
    return write_config(
        work / "grpod.toml",
        {
            "engine": engine,
            "daemon": {"metrics": False, "log_format": "json", "checkpoint_every": 2},
            "forensics": {"episode_gap_steps": 0},  # one incident per drill
            "guards.weight_sync": {"action": "FLUSH"},  # go on after each (HALT by default)
        },
    )


def test_a_vllm_campaign_stops_resumes_records_the_drills_and_replays(tmp_path: Path) -> None:
    model = build_hf_dir(tmp_path / "model", hidden_size=128, max_positions=512)
    work = tmp_path / "work"
    work.mkdir()
    campaign(work, model)
    args = ["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "14"]

    def stop_at_step_1(event: dict[str, Any]) -> None:
        if event["event"] == "step" and event["step"] == 1:
            first.signal(signal.SIGTERM)

    # a one-page log pipe: the daemon is never more than a page of log past the signal
    first = Grpod(args, work, on_event=stop_at_step_1, pipe_bytes=4096)
    assert first.wait(timeout=300) == 0, first.stderr[-3000:]
    stopped = [e["step"] for e in first.steps()]
    assert stopped[0] == 0 and max(stopped) < min(DRILLS), stopped
    assert "stopped by SIGTERM" in json.dumps(first.event("stopping"))

    second = Grpod(args, work)
    assert second.wait(timeout=300) == 0, second.stderr[-3000:]
    started = second.event("started")
    assert started["resumed_from"] is not None and started["next_step"] <= max(stopped) + 1
    steps = {e["step"]: e for e in second.steps()}
    assert set(range(max(stopped) + 1, 14)) <= set(steps)
    for step, event in steps.items():
        assert event["weight_version"] is not None
        if step in DRILLS:  # the weights compared on the rollout: after the forward
            flushed = DRILLS[step] in ("sync-skip", "sync-corrupt")
            assert event["outcome"] == ("flushed" if flushed else "skipped"), event
            guards = [f["guard"] for f in event["findings"]]
            assert "weight_sync" in guards and set(guards) <= {"weight_sync", "sampler_mismatch"}
            assert not float(event["weight_sync_max_abs_logprob_diff"]) <= 1e-3, event  # or NaN
        else:
            assert event["outcome"] == "applied", event
            assert event["weight_sync_max_abs_logprob_diff"] <= 1e-4, event
            assert event["mismatch_p99"] <= 1e-4, event

    listed = cli("incidents", "list", "--run-dir", "run", "--json", cwd=work)
    assert listed.returncode == 0, listed.stderr
    incidents = [i for i in json.loads(listed.stdout) if i["guard"] == "weight_sync"]
    assert [i["step"] for i in incidents] == sorted(DRILLS), incidents
    assert [i["outcome"] for i in incidents] == ["flushed", "skipped", "flushed"], incidents

    # drills caught after the forward and before it, and a trained step (vLLM's samples)
    for step in (8, 10, 11):
        done = cli("replay", "--run-dir", "run", "--step", str(step), "--json", cwd=work)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["reproduced"] is True and result["step"] == step, result
    assert MAIN_GRPOD.is_file(), "make test-vllm builds .venv first"
    done = subprocess.run(
        [str(MAIN_GRPOD), "replay", "--run-dir", "run", "--step", "11", "--json"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr  # an environment without vLLM replays it
    assert json.loads(done.stdout)["reproduced"] is True
