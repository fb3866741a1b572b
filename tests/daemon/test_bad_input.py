"""Bad model, tokenizer, task and reward input: one line, exit 2, nothing created; system
failures before the first step (read-only parent, full disk) leave no run dir behind."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import GRPOD, cli, write_config
from tests.daemon.ownmodel import user_campaign
from tests.hfdir import build_hf_dir

pytestmark = pytest.mark.slow


class Toml(str):
    """A value written into grpod.toml as is (an inline table), not as JSON."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good model dir, and bad variants of it."""
    root = tmp_path_factory.mktemp("models")
    good = build_hf_dir(root / "good")
    nopad = build_hf_dir(root / "nopad", pad_token=None)
    # a pad token added past the model's embedding: id 320 of a 320-row vocabulary
    padout = build_hf_dir(root / "padout", pad_token="<|pad|>", model_vocab_size=320)
    notok = root / "notok"
    shutil.copytree(good, notok)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (notok / name).unlink(missing_ok=True)
    truncated = root / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return dict(good=good, nopad=nopad, padout=padout, notok=notok, truncated=truncated)


def test_config_check_names_each_bad_model_task_and_reward(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    good = user_campaign(tmp_path, models["good"])
    short, long = ({"prompt": "7+8=" * n, "answer": "5"} for n in (1, 20))
    (tmp_path / "long.jsonl").write_text(f"\n{json.dumps(short)}\n{json.dumps(long)}\n")
    (tmp_path / "few.jsonl").write_text((json.dumps(short) + "\n") * 3)
    (tmp_path / "latin1.jsonl").write_bytes(
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xe9"}\n'
    )
    cases = {  # name: (engine overrides, what its error line must say; None = ok)
        "good": ({}, None),
        "nopad": ({"model": str(models["nopad"])}, None),  # pads with eos, as HF does
        "padout": ({"model": str(models["padout"])}, "pad token id 320 is outside the model's"),
        "notok": ({"model": str(models["notok"])}, "no tokenizer files"),
        "truncated": ({"model": str(models["truncated"])}, "model.safetensors: truncated"),
        "long": ({"task": "long.jsonl"}, "task long.jsonl: line 3 ('7+8=7+8="),  # blank line 1
        "evalfew": ({"eval_task": "few.jsonl", "eval_samples": 3}, None),
        "evalmany": (
            {"eval_task": "few.jsonl", "eval_samples": 4},
            "eval_samples 4: eval_task few.jsonl has 3 prompts",
        ),
        "lora": ({"lora": Toml('{rank = 4, target_modules = ["q_proj"]}')}, None),
        "nolayer": (
            {"lora": Toml('{rank = 4, target_modules = ["nope"]}')},
            "engine.lora: Target modules {'nope'} not found in the base model",
        ),
        "mlp": (  # PEFT's error quoted whole: its module repr spans lines
            {"lora": Toml('{rank = 4, target_modules = ["mlp"]}')},
            "engine.lora: Target module Qwen2MLP( (gate_proj): Linear(",
        ),
        "tied": (
            {"lora": Toml('{rank = 4, target_modules = ["lm_head"]}')},
            "engine.lora: target_modules: lm_head shares its weight with the input embeddings",
        ),
        "latin1": ({"task": "latin1.jsonl"}, "latin1.jsonl: line 2 is not UTF-8 (byte 0xe9"),
        "raises": ({"reward": "myrewards:boom"}, "RuntimeError: no reward today"),
        "text": ({"reward": "myrewards:text"}, "returned str, not a number"),
        "nan": (
            {"reward": "myrewards:nan"},
            "myrewards:nan returned nan, not a finite number",
        ),
        "absent": ({"reward": "nosuchmodule:f"}, "reward 'nosuchmodule:f': cannot import"),
        "lr": ({"lr": "1e-3"}, "engine.lr: Input should be a valid number (got '1e-3')"),
        "group": ({"group_size": 1}, "engine.group_size: Value error, GRPO needs groups"),
    }
    if importlib.util.find_spec("vllm") is None:
        cases["vllm"] = ({"rollout_backend": "vllm"}, "rollout_backend vllm: vllm is not installed")
    files = []
    base = (tmp_path / "grpod.toml").read_text()
    for name, (engine, _) in cases.items():
        text = base
        for key, value in engine.items():  # replace the key's line, or add it
            line = f"{key} = {value if isinstance(value, Toml) else json.dumps(value)}"
            lines = [x for x in text.splitlines() if not x.startswith(f"{key} =")]
            lines.insert(lines.index("[engine]") + 1, line)
            text = "\n".join(lines) + "\n"
        (tmp_path / f"{name}.toml").write_text(text)
        files.append(f"{name}.toml")
    done = cli("config", "check", *files, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == [f"{n}.toml: ok" for n, (_, e) in cases.items() if not e]
    errors = done.stderr.splitlines()
    expected = [(n, e) for n, (_, e) in cases.items() if e]
    assert len(errors) == len(expected), done.stderr
    for line, (name, needle) in zip(errors, expected):
        assert line.startswith(f"grpod config: error: {name}.toml: "), line
        assert needle in line, (name, line)
    mlp = errors[[n for n, _ in expected].index("mlp")]
    assert "is not supported. Currently, only the following modules are supported" in mlp
    assert "Traceback" not in done.stderr and good.is_file()


def test_run_refuses_bad_input_before_creating_anything(tmp_path: Path, models: dict[str, Path]):
    user_campaign(tmp_path, models["good"], task="long.jsonl")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "7+8=" * 20, "answer": "5"}) + "\n")
    done = cli("run", "--config", "grpod.toml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "seq_len 32 leaves 30" in done.stderr, done.stderr
    assert not (tmp_path / "var").exists() and done.stdout == ""


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[callable]:
    """`mount(options)`: a small tmpfs of our own (root only), unmounted afterwards."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)])
        if done.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_read_only_parent_and_full_disk_leave_no_run_dir(tmp_path: Path, mount) -> None:
    config = write_config(
        tmp_path / "grpod.toml",
        {
            "engine": {"task": "copy", "prompts_per_step": 2, "group_size": 2, "threads": 1},
            "daemon": {"metrics": False, "log_format": "json"},
        },
    )
    readonly = mount("size=1m,ro")
    done = cli("run", "--config", str(config), "--run-dir", str(readonly / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Read-only file system" in done.stderr, done.stderr
    # 3 MiB: the run dir and store fit, the tiny model's first checkpoint (12 MB) does not
    small = mount("size=3m")
    done = cli("run", "--config", str(config), "--run-dir", str(small / "run"), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert list(small.iterdir()) == []  # no run dir a restart would resume, no temp leftovers


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    read, write = os.pipe()
    os.close(read)  # gone before the child starts: every write it makes hits a closed pipe
    try:
        proc = subprocess.Popen(
            [GRPOD, "config", "example"], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=60)
    assert err == "" and proc.returncode == 141
