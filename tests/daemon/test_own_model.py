"""A user's own HF model, JSONL task and reward module (found from the working directory, no
PYTHONPATH): `grpod run` with progress on and stdout piped keeps its JSON step events; replay
from the same directory reproduces a step. And README's "Your own model and task", run as a
user would: real `grpod` subprocesses on a real Hugging Face directory (tiny Qwen2, BPE
tokenizer, chat template), a JSONL task, two weighted rewards, stop strings, held-out
evaluation, decoded samples and export."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.daemon.helpers import cli, run_to_end, write_config
from tests.daemon.ownmodel import user_campaign
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
NAN_STEP = 1  # an injected NaN loss: a flushed step with an incident to show and export
REWARDS = """\
def correct(prompt, completion, answer):
    return 1.0 if completion.strip() == answer else 0.0

def brief(prompt, completion, answer):
    return -len(completion) / 100
"""


def readme_config() -> dict[str, dict[str, Any]]:
    """The TOML file of README's walk-through, as the user copies it."""
    section = (ROOT / "README.md").read_text().split("## Your own model and task", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, flags=re.S)
    assert block, "README's walk-through has no TOML file"
    return tomllib.loads(block.group(1))


@dataclass
class Campaign:
    where: Path
    evals_on: Any  # the README config (eval on), stopped at step 2 and resumed
    evals_off: Any  # the same with eval_every = 0, uninterrupted
    config: dict[str, dict[str, Any]]

    def cli(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        """A read-only command in this process (the runs themselves are subprocesses)."""
        from grpod.daemon.cli import main

        capsys.readouterr()
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(self.where)
            patch.syspath_prepend(str(self.where))  # as the runs find it from their cwd
            code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    def grpod(self, *args: str) -> subprocess.CompletedProcess:
        return cli(*args, cwd=self.where)


ENV = {"OMP_NUM_THREADS": "1"}  # no PYTHONPATH: the runs find myrewards.py from their cwd


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    where = tmp_path_factory.mktemp("my-campaign")
    model = build_hf_dir(where / "model")
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 0]  # <|im_end|> and <|endoftext|>, as Qwen2-Instruct
    (model / "generation_config.json").write_text(json.dumps(generation))
    (where / "data").mkdir()
    for name, numbers in (("train", range(0, 5)), ("heldout", range(5, 8))):
        lines = [
            json.dumps({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
            for a in numbers
            for b in range(3)
        ]
        (where / "data" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (where / "myrewards.py").write_text(REWARDS)
    config = readme_config()
    config["engine"] |= {"threads": 1, "device": "cpu"}  # replay is bit-exact on CPU
    config["engine.faults"] = {"nan_loss_steps": [NAN_STEP]}
    config["daemon"] |= {
        "metrics_port": 0, "log_format": "json", "progress": "off", "state_digest_on_exit": True,
    }  # fmt: skip
    on = write_config(where / "grpod.toml", config)
    off = write_config(
        where / "no-eval.toml", {**config, "engine": {**config["engine"], "eval_every": 0}}
    )
    env = ENV
    first = run_to_end(["--config", str(on), "--max-steps", "2"], where, env)
    assert first.event("stopped")["next_step"] == 2
    resumed = run_to_end(["--run-dir", "runs/first", "--max-steps", str(STEPS)], where, env)
    plain = run_to_end(
        ["--config", str(off), "--run-dir", "runs/no-eval", "--max-steps", str(STEPS)], where, env
    )
    return Campaign(where, (first, resumed), plain, config)


def test_chat_prompts_stops_and_weighted_rewards(campaign: Campaign) -> None:
    from transformers import AutoTokenizer

    first, resumed = campaign.evals_on
    steps = {e["step"]: e for e in first.steps() + resumed.steps()}
    assert sorted(steps) == list(range(STEPS))
    engine = campaign.config["engine"]
    names = engine["rewards"]
    for event in steps.values():
        assert sorted(event["rewards"]) == sorted(names)
        total = sum(
            w * event["rewards"][n]["mean"] for n, w in zip(names, engine["reward_weights"])
        )
        assert event["reward_mean"] == pytest.approx(total, abs=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(campaign.where / "model")
    system = {"role": "system", "content": engine["system_prompt"]}
    shown = [s for e in steps.values() for s in e["samples"]]
    assert len(shown) == STEPS * campaign.config["daemon"]["log_samples"]
    for sample in shown:
        question = re.search(r"user\n(What is \d\+\d\?)<\|im_end\|>", sample["prompt"]).group(1)
        messages = [system, {"role": "user", "content": question}]
        assert sample["prompt"] == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )  # the tokenizer's own template, system prompt first, generation prompt last
        assert "\n" not in sample["completion"]  # cut before the stop string
        assert set(sample["rewards"]) == set(names)
    cut = [e["completion_length_mean"] < engine["max_new_tokens"] for e in steps.values()]
    assert any(cut)  # some completions stopped early (a stop id or the "\n" string)


def test_incident_shows_and_exports_the_decoded_samples(
    campaign: Campaign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpod.engine import TransportBatch

    _, listed, _ = campaign.cli(capsys, "incidents", "list", "--run-dir", "runs/first", "--json")
    ident = str(next(i["id"] for i in json.loads(listed) if i["step"] == NAN_STEP))
    code, shown, err = campaign.cli(
        capsys, "incidents", "show", ident, "--run-dir", "runs/first", "--samples", "3"
    )
    assert code == 0, err
    assert f"incident {ident}: step {NAN_STEP} FLUSH" in shown
    assert shown.count("    completion: ") == 3 and "<|im_start|>assistant" in shown
    out = tmp_path / "incident-1"
    exported = campaign.grpod("incidents", "export", ident, str(out), "--run-dir", "runs/first")
    assert exported.returncode == 0, exported.stderr
    batch = TransportBatch.load(out / "batch.safetensors")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["sample"] for s in samples] == list(range(batch.num_samples))
    assert [s["reward"] for s in samples] == batch.rewards.tolist()
    for name, values in batch.function_rewards.items():
        assert [s["rewards"][name] for s in samples] == values
    _, as_json, _ = campaign.cli(
        capsys, "incidents", "show", ident, "--run-dir", "runs/first", "--json"
    )
    assert json.loads(as_json)["completions"] == samples[:2]  # log_samples = 2


def test_eval_never_touches_the_policy_or_the_cursor(
    campaign: Campaign, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpod.forensics import Store

    first, resumed = campaign.evals_on
    evals = [e for g in (first, resumed) for e in g.events if e["event"] == "eval"]
    every = campaign.config["engine"]["eval_every"]
    assert [e["step"] for e in evals] == list(range(every, STEPS + 1, every))
    for event in evals:
        assert event["temperature"] == 0.0 and event["samples"] == 8
        assert set(event["rewards"]) == {"total", *campaign.config["engine"]["rewards"]}
    digest = resumed.event("stopped")["state_digest"]
    assert digest == campaign.evals_off.event("stopped")["state_digest"]  # eval on == off
    assert not [e for e in campaign.evals_off.events if e["event"] == "eval"]
    store = Store(campaign.where / "runs/first", create=False)
    try:
        with store.session() as session:
            stored = [(e.step, json.loads(e.rewards_json)) for e in store.evals(session)]
    finally:
        store.close()
    assert stored == [(e["step"], e["rewards"]) for e in evals]
    code, replayed, err = campaign.cli(
        capsys, "replay", "--run-dir", "runs/first", "--step", "3", "--json"
    )
    assert code == 0, replayed + err
    assert json.loads(replayed)["reproduced"] is True  # after an eval and a resume


def test_export_is_a_directory_transformers_loads(
    campaign: Campaign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf-out"
    done = campaign.grpod("export", "--run-dir", "runs/first", "--step", "2", str(out))
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    trained = load_file(campaign.where / "runs/first/checkpoints/step-00000002/model.safetensors")
    weights = model.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in trained.items())
    assert model.generation_config.eos_token_id == [2, 0]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )  # fmt: skip
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    code, _, err = campaign.cli(capsys, "export", "--run-dir", "runs/first", str(out))
    assert code == 2 and err.strip().endswith("exists and is not an empty directory")
    never = str(tmp_path / "never")
    code, _, err = campaign.cli(capsys, "export", "--run-dir", "runs/first", "--step", "3", never)
    assert code == 2 and not Path(never).exists()
    assert err.strip().endswith("no checkpoint at that step in runs/first (have 0, 2, 4)")


def test_own_model_task_and_reward_run_and_replay(tmp_path: Path) -> None:
    model = build_hf_dir(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    config = user_campaign(work, model)
    text = config.read_text().replace("[daemon]\n", '[daemon]\nprogress = "on"\n')
    config.write_text(text)
    env = {"PYTHONPATH": os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", "")] if p)}
    run = run_to_end(["--config", "grpod.toml", "--run-dir", "run", "--max-steps", "3"], work, env)
    steps = run.steps()  # stdout is a pipe: the step events stay beside the progress bar
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert all(0.0 <= e["reward_mean"] <= 1.0 for e in steps)
    assert "reward 0." in run.stderr  # the bar went to stderr
    done = cli("replay", "--run-dir", "run", "--step", "2", "--json", cwd=work, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["reproduced"] is True and result["step"] == 2
